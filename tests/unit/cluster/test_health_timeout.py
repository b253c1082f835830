"""`up --health-timeout-s`: how long each child may take to become healthy. It was a fixed 180 s, too
short for an instance loading a large model (the systemd instance unit allows 900 s) and too long to
wait for a child that will never come up."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cluster.__main__ import build_spec, parse_args
from services.cluster.processes import ROOT
from services.common.etcd_launcher import free_port

pytestmark = pytest.mark.timeout(60)

# The launcher's main() with a manager that never answers its health check (a child that starts slowly).
_LAUNCHER_WITH_A_SLOW_MANAGER = """
import sys
from services.cluster import __main__ as cluster_main
from services.cluster.processes import ServiceProcess

async def probe(process):
    return process.name != "manager-0"
ServiceProcess._probe = probe
sys.exit(cluster_main.main(["up", "--model", sys.argv[1], "--engine", "sim", "--http-port", sys.argv[2],
                            "--admin-port", sys.argv[3], "--health-timeout-s", "1.5"]))
"""


def test_the_default_is_180_s(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert build_spec(parse_args(["up", "--model", str(tmp_path)])).health_timeout_s == 180.0
    assert build_spec(parse_args(["up", "--model", str(tmp_path), "--health-timeout-s", "900"])).health_timeout_s == 900


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exited:
        parse_args(["up", "--health-timeout-s", value])
    assert exited.value.code == 2 and "--health-timeout-s must be positive" in capsys.readouterr().err


def test_a_child_not_healthy_within_the_timeout_fails_up_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = subprocess.run([sys.executable, "-c", _LAUNCHER_WITH_A_SLOW_MANAGER, str(tmp_path), str(free_port()),
                             str(free_port())], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "cluster failed to start: manager-0 not healthy after 1.5 s (--health-timeout-s" in result.stderr, \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
