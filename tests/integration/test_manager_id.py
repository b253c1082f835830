"""Two managers with one id, as real processes on a real etcd: the second refuses to start while the first lives,
naming its address and --manager-id; once the first is gone (killed: its lease runs out) the id is free again.

Before, both were accepted (the default id is <hostname>-<port>: two hosts with one hostname): ferryctl took the
standby's answers for the leader's, whose id they carried.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.integration.manager_harness import ROOT, leader_of, start_manager, wait_until

pytestmark = pytest.mark.timeout(120)

LEASE_TTL_S = 2


async def _start_expecting_exit(etcd_endpoint: str, cluster: str, manager_id: str, log_path, timeout_s: float) -> tuple[
        int, str, str]:
    """A manager started with `manager_id`: (exit status, its `ready` line if it printed one, its log). One that
    got ready is killed at once (status -9)."""
    with open(log_path, "ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.manager", "--port", "0", "--etcd-endpoints", etcd_endpoint, "--cluster",
            cluster, "--manager-id", manager_id, "--lease-ttl-s", str(LEASE_TTL_S), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=log_file)
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout_s)  # b"": stdout closed, it is exiting
        if line:
            process.kill()
        await asyncio.wait_for(process.wait(), 10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, line.decode(), log_path.read_text()


async def test_a_second_manager_with_a_live_managers_id_refuses_to_start(etcd, cluster, tmp_path):
    first = await start_manager(etcd.endpoint, cluster, "m-same", tmp_path, "--lease-ttl-s", str(LEASE_TTL_S))
    try:
        await wait_until(lambda: leader_of(first), 20, "the first manager leading")
        status, ready, log = await _start_expecting_exit(etcd.endpoint, cluster, "m-same", tmp_path / "second.log", 60)
        assert (status, ready) == (1, ""), log[-2000:]
        assert "startup_failed" in log and f"at {first.address}" in log and "--manager-id" in log, log[-2000:]
        assert await leader_of(first) == "m-same"  # the first goes on, leading
        first.kill()  # no resign, no revoke: its record goes with its lease
        await first.process.wait()
        (tmp_path / "third").mkdir()
        second = await start_manager(etcd.endpoint, cluster, "m-same", tmp_path / "third", "--lease-ttl-s",
                                     str(LEASE_TTL_S))
        try:
            await wait_until(lambda: leader_of(second), 20, "the manager that took the freed id leading")
        finally:
            await second.stop()
    finally:
        await first.stop()
