"""An instance's own drain mark (SIGTERM) against a real etcd: it lives under the instance's lease,
yields to an operator's mark, and a restarted process clears one its killed predecessor left."""

from __future__ import annotations

import pytest
from etcd3aio import Etcd3Client

from services.common.etcd_launcher import LocalEtcd
from services.common.registry import DRAIN_MARKS, Registry
from services.instance.app import clear_stale_self_drain, drain_self

pytestmark = pytest.mark.timeout(60)

INSTANCE = "i-0"
MARK = f"{DRAIN_MARKS}/{INSTANCE}"


@pytest.fixture
async def processes(etcd: LocalEtcd, cluster: str):
    """The registries of an instance's killed process and of its restart (same id, new lease)."""
    killed = Registry([etcd.endpoint], cluster, ttl_s=30.0)  # SIGKILLed: its lease outlives it
    restarted = Registry([etcd.endpoint], cluster, ttl_s=30.0)
    yield killed, restarted
    await restarted.close()
    await killed.close()


async def test_a_restart_clears_the_self_drain_its_killed_predecessor_left(processes) -> None:
    killed, restarted = processes
    await drain_self(killed, INSTANCE)
    assert (await restarted.get_json(MARK))["drained_by"] == "shutdown"
    await clear_stale_self_drain(restarted, INSTANCE)  # not after the old lease's 30 s
    assert await restarted.get_json(MARK) is None


async def test_an_operators_drain_mark_is_kept_by_a_self_drain_and_by_a_restart(processes) -> None:
    killed, restarted = processes
    operator_mark = {"instance_id": INSTANCE, "drained_by": "m-1", "drained_at": 1.0}
    await restarted.put_json(MARK, operator_mark)
    await drain_self(killed, INSTANCE)
    await clear_stale_self_drain(restarted, INSTANCE)
    assert await restarted.get_json(MARK) == operator_mark


async def test_a_mark_that_is_not_json_does_not_stop_the_restart(processes, etcd, cluster) -> None:
    _, restarted = processes
    async with Etcd3Client([etcd.endpoint]) as client:
        await client.kv.put(f"/ferry/{cluster}/{MARK}", b"{not json")
    await clear_stale_self_drain(restarted, INSTANCE)  # no exception: the mark is left for an operator
    async with Etcd3Client([etcd.endpoint]) as client:
        assert (await client.kv.get(f"/ferry/{cluster}/{MARK}")).kvs
