"""A signal while the launcher is still starting stops what it already started, etcd included."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pathlib
import pty
import signal
import subprocess
import sys
import termios
import time

import pytest

from services.cluster.launcher import LocalCluster, run_until_signalled
from services.cluster.processes import ROOT
from services.common.etcd_launcher import LocalEtcd, free_port
from tests.unit.cluster.test_ports import spec as ports_spec

pytestmark = pytest.mark.timeout(30)


async def test_a_signal_while_etcd_starts_stops_etcd_and_removes_its_temp_dir(monkeypatch):
    """Before, etcd was the cluster's only once healthy: a Ctrl-C in its first second left it running
    (until the launcher exited and the kernel SIGKILLed it) and its temp data dir behind."""
    started: list[LocalEtcd] = []
    real_spawn = LocalEtcd._spawn

    def spawn(etcd: LocalEtcd) -> None:
        real_spawn(etcd)
        started.append(etcd)

    monkeypatch.setattr(LocalEtcd, "_spawn", spawn)
    monkeypatch.setattr(LocalEtcd, "_probe_healthy", lambda etcd: False)  # still starting when the signal comes
    launcher = asyncio.create_task(run_until_signalled(LocalCluster(ports_spec(free_port(), free_port()))))
    while not started:
        await asyncio.sleep(0.01)
    etcd, process = started[0], started[0]._process
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(launcher, 15)
        assert process.poll() is not None, "etcd still runs after the launcher stopped"
        assert not etcd.data_dir.exists()
    finally:
        process.kill()
        process.wait(10)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)


# The launcher's main() with etcd never healthy (so it is still starting), writing the dir etcd
# keeps its data in to argv[1] once etcd runs.
_LAUNCHER_WHILE_ETCD_STARTS = """
import pathlib, sys
from services.cluster import __main__ as cluster_main
from services.common.etcd_launcher import LocalEtcd

real_spawn = LocalEtcd._spawn
def spawn(etcd):
    real_spawn(etcd)
    pathlib.Path(sys.argv[1]).write_text(f"{etcd.pid} {etcd.data_dir}")
LocalEtcd._spawn = spawn
LocalEtcd._probe_healthy = lambda etcd: False
sys.exit(cluster_main.main(["up", "--model", sys.argv[2], "--http-port", sys.argv[3], "--admin-port", sys.argv[4]]))
"""


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _start_launcher(tmp_path: pathlib.Path, output: int, **popen_args) -> tuple[subprocess.Popen, pathlib.Path]:
    """The launcher, writing to `output`, once etcd runs; and the dir etcd keeps its data in."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    started = tmp_path / "etcd"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER_WHILE_ETCD_STARTS, str(started), str(model), str(free_port()),
         str(free_port())], stdout=output, stderr=output, start_new_session=True, cwd=ROOT, **popen_args)
    os.close(output)
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return launcher, pathlib.Path(started.read_text().split(" ", 1)[1])


def test_closing_the_terminal_still_stops_every_child(tmp_path):
    """After the terminal closes, each line the launcher logs while stopping fails (EIO): before, the first
    one aborted the stop, so etcd and the services were left to the kernel's SIGKILL, its temp dirs and
    cluster.json stayed and the launcher exited 1."""
    terminal, its_end = pty.openpty()
    launcher, data_dir = _start_launcher(tmp_path, its_end, stdin=its_end, preexec_fn=_take_terminal)
    try:
        os.close(terminal)  # the terminal goes away: SIGHUP
        assert launcher.wait(20) == 0
        assert not data_dir.exists()
    finally:
        launcher.kill()
        launcher.wait(10)


def test_ctrl_c_on_up_piped_into_tee_still_stops_every_child(tmp_path):
    """`up 2>&1 | tee cluster.log`: Ctrl-C ends tee as well, and each line logged while stopping fails (EPIPE)."""
    reader, writer = os.pipe()
    launcher, data_dir = _start_launcher(tmp_path, writer)
    try:
        os.close(reader)  # tee is gone
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(20) == 0
        assert not data_dir.exists()
    finally:
        launcher.kill()
        launcher.wait(10)
