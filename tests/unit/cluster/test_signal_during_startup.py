"""A signal while the launcher is still starting stops what it already started, etcd included."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.cluster.launcher import LocalCluster, run_until_signalled
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
