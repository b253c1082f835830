"""A child service process finds what its parent was given on PYTHONPATH, after this checkout: on a GPU
machine the wheels scripts/device_check.sh unpacks with `pip install --target` reach Python only that way."""

import os
import sys

import pytest

from services.cluster.processes import ROOT, ServiceProcess, child_python_path

pytestmark = pytest.mark.timeout(60)

_PRINTS_PYTHONPATH = "import os, sys; print(os.environ['PYTHONPATH'], sys.path[1:3], flush=True)"


def test_the_checkout_comes_first_then_the_parents_entries():
    assert child_python_path({"PYTHONPATH": f"/tmp/site{os.pathsep}{os.pathsep}/opt/x"}) == \
        os.pathsep.join([str(ROOT), "/tmp/site", "/opt/x"])
    assert child_python_path({}) == str(ROOT)


def test_a_started_child_inherits_the_parents_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    # The prefix runs first and ends the child: it prints the environment `python -m services.x` would get.
    child = ServiceProcess("probe", "none", [], "", tmp_path, prefix=[sys.executable, "-c", _PRINTS_PYTHONPATH])
    assert child.start().popen.wait(timeout=30) == 0
    printed = child.log_path.read_text()
    assert printed.startswith(os.pathsep.join([str(ROOT), str(tmp_path / "site")]))
    assert str(tmp_path / "site") in printed.split(" ", 1)[1]  # on the child's sys.path
