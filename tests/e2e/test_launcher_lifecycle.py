"""`python -m services.cluster up` never leaves a child behind: a hang-up (closed terminal)
stops every child gracefully, and a launcher killed outright takes every child with it."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.conftest import launched_cluster, wait_for

pytestmark = pytest.mark.timeout(180)


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["hangup", "killed"])
async def test_no_child_outlives_the_launcher(tiny_model_dir, tmp_path, sig):
    with launched_cluster(tiny_model_dir, tmp_path / "state", "--instances", "1", "--kv-cache-mib", "16") as cluster:
        pids = [process["pid"] for process in cluster["processes"]]  # etcd, manager, transfer, instance, frontend
        assert len(pids) == 5 and all(is_running(pid) for pid in pids)
        try:
            os.kill(cluster["launcher_pid"], sig)

            async def gone() -> bool:
                return not any(is_running(pid) for pid in pids)
            await wait_for(gone, 30, "every child exited")
        finally:  # on failure, end the children this test started
            for pid in filter(is_running, pids):
                os.kill(pid, signal.SIGKILL)
