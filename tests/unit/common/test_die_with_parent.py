"""die_with_parent: the wrapped command keeps the wrapper's pid and dies with its parent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from services.common import die_with_parent

pytestmark = pytest.mark.timeout(60)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init is gone for our purpose
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_the_command_runs_under_the_wrappers_pid():
    completed = subprocess.Popen(die_with_parent.command([sys.executable, "-c", "import os; print(os.getpid())"]),
                                 stdout=subprocess.PIPE, text=True)
    out, _ = completed.communicate(timeout=30)
    assert completed.returncode == 0 and int(out) == completed.pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_the_command_is_killed_when_its_parent_exits():
    parent_code = ("import subprocess, sys; from services.common import die_with_parent; "
                   "child = subprocess.Popen(die_with_parent.command(['sleep', '60'])); "
                   "print(child.pid, flush=True); sys.stdin.readline()")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    child_pid = int(parent.stdout.readline())
    try:
        time.sleep(0.3)  # the wrapper has exec'd sleep
        assert _is_alive(child_pid)
        parent.stdin.close()  # the parent exits
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _is_alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)
        parent.kill()


def test_a_parent_gone_before_the_signal_is_armed_means_no_command(tmp_path):
    marker = tmp_path / "ran"
    completed = subprocess.run([sys.executable, "-I", die_with_parent.__file__, "1", "touch", str(marker)],
                               capture_output=True, text=True, timeout=30)
    assert completed.returncode != 0 and "exited before touch started" in completed.stderr
    assert not marker.exists()
