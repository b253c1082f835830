"""The launcher's etcd as a supervised child (a real etcd): whatever ends it, it starts again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import structlog

from services.cluster.launcher import EtcdChild
from services.cluster.supervisor import RestartPolicy, Supervisor, supervise_step
from services.common.etcd_launcher import LocalEtcd

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_an_etcd_ended_by_any_signal_is_started_again(tmp_path, sig):
    """A SIGTERM from someone else (pkill, an OOM killer's polite phase) counts as clean for the services,
    which then stay down; etcd must come back all the same (before the fix it stayed down)."""
    etcd = await LocalEtcd(data_dir=tmp_path / "data", log_dir=tmp_path / "logs").start_async()
    try:
        supervisor, child, old_pid = Supervisor(RestartPolicy(first_delay_s=0.1)), EtcdChild(etcd), etcd.pid
        os.kill(old_pid, sig)
        with structlog.testing.capture_logs() as logs:
            async with asyncio.timeout(20):
                while not (etcd.is_running and etcd.pid != old_pid):
                    await supervise_step(supervisor, [child], time.monotonic())
                    await asyncio.sleep(0.1)
        exits = [entry["returncode"] for entry in logs if entry["event"] == "process_exited"]
        assert len(exits) == 1 and exits[0] is not None  # its real exit status, not "unknown"
    finally:
        etcd.stop()
