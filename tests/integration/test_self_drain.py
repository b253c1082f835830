"""An instance's own drain mark (SIGTERM) against a real etcd: it lives under the instance's lease,
yields to an operator's mark, and a restarted process clears one its killed predecessor left."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from etcd3aio import Etcd3Client
from structlog.testing import capture_logs

from services.common.etcd_client import Lease
from services.common.etcd_launcher import LocalEtcd
from services.common.registry import DRAIN_MARKS, Registry
from services.common.registry_marks import Marks
from services.instance.app import clear_stale_self_drain, drain_self
from tests.integration.eventually import eventually

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


@pytest.fixture
async def draining(etcd: LocalEtcd, cluster: str):
    """A registered instance's registry (short TTL) that has drained itself, and a raw etcd client (the operator)."""
    registry = Registry([etcd.endpoint], cluster, ttl_s=2.0)
    await registry.register("instances", INSTANCE, {"address": "127.0.0.1:1"})
    await drain_self(registry, INSTANCE)
    async with Etcd3Client([etcd.endpoint]) as client:
        yield registry, client
    await registry.close()


async def test_a_lost_member_key_put_back_does_not_restore_a_self_drain_an_operator_undid(draining, cluster) -> None:
    """An operator's Undrain deleted the self-drain mark, and the instance's record was lost too (an `etcdctl del`):
    putting the record back put the mark back with it, and the instance drained again. A mark deleted while the
    lease it was put under lives is withdrawn now, never put back."""
    registry, client = draining
    record, mark = registry.key("instances", INSTANCE), f"/ferry/{cluster}/{MARK}"
    await client.kv.delete(mark, timeout=5)  # the operator's Undrain
    await client.kv.delete(record, timeout=5)
    await eventually(lambda: registry.num_reregistrations == 1, what="the record put back")
    await asyncio.sleep(1.0)  # a renewal or two more
    assert (await client.kv.get(record, timeout=5)).kvs
    assert not (await client.kv.get(mark, timeout=5)).kvs, "the operator's Undrain was undone"
    assert not registry.holds(DRAIN_MARKS, INSTANCE)


async def test_a_self_drain_gone_with_an_expired_lease_is_put_back(draining, cluster) -> None:
    """The mark lives under the instance's lease: a lease lost (etcd away past the TTL) takes it, and the instance,
    still draining itself, puts it back with its record."""
    registry, client = draining
    old_lease = registry.lease_id
    await client.lease.revoke(old_lease, timeout=5)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id != old_lease and json.loads(kv.value)["drained_by"] == "shutdown"


async def test_a_self_drain_gone_with_a_lease_that_ended_just_after_a_renewal_is_put_back(
        draining, cluster, monkeypatch) -> None:
    """The lease ended between a renewal and that renewal's read-back of the keys (revoked then, or expired while the
    instance was frozen between the two): the read found the record and the mark both gone, and the mark was taken
    for one an operator's Undrain deleted while the lease lived: withdrawn, never put back. A mark is judged so now
    only where the same read shows the lease still holding the records."""
    registry, client = draining
    old_lease, renew = registry.lease_id, Lease.keepalive

    async def renew_then_end(lease: Lease) -> bool:
        is_alive = await renew(lease)
        if is_alive and lease.lease_id == old_lease:
            await client.lease.revoke(old_lease, timeout=5)  # just after the renewal etcd answered
        return is_alive
    monkeypatch.setattr(Lease, "keepalive", renew_then_end)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id != old_lease and registry.holds(DRAIN_MARKS, INSTANCE)


async def test_an_operators_drain_over_a_self_drain_leaves_the_instance_registered(draining, cluster) -> None:
    """An operator's Drain written over the self-drain mark (no lease), then a lost lease: the registry took the mark
    for an id another process held (`member_id_taken`) and stayed unregistered. The mark is the operator's now:
    withdrawn here, and the instance registers again."""
    registry, client = draining
    operator_mark = {"instance_id": INSTANCE, "drained_by": "m-1", "drained_at": 1.0, "owner": "operator"}
    await registry.put_json(MARK, operator_mark)
    await client.lease.revoke(registry.lease_id, timeout=5)
    await eventually(lambda: registry.num_reregistrations == 1 and registry.is_registered, what="re-registration")
    assert await registry.get_json(MARK) == operator_mark
    await registry.close()  # its lease goes: the operator's mark stays
    async with Etcd3Client(registry.endpoints) as other:
        assert json.loads((await other.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs[0].value) == operator_mark


async def test_a_self_drain_gone_with_a_lease_that_ended_as_the_records_were_put_back_is_put_back(
        draining, cluster, monkeypatch) -> None:
    """The lease ended (revoked, or expired while the instance was frozen) between the registry's put of its records
    back under it (one was deleted: `etcdctl del`) and its read of the mark: the mark, put under that lease and gone
    with it, was taken for one an operator's Undrain deleted while the lease lived, and withdrawn for good. A mark
    gone under the current lease now counts as deleted only where etcd says after the read that the lease lives;
    else that round fails, and the next, under a new lease, reads etcd's history as for any lease that ended."""
    registry, client = draining
    old_lease, put_back = registry.lease_id, Marks.put_back

    async def end_lease_then_put_back(marks: Marks, etcd: Etcd3Client, key: str, value, lease_id: int, *args):
        if lease_id == old_lease:
            await client.lease.revoke(old_lease, timeout=5)  # just after the records' put
        return await put_back(marks, etcd, key, value, lease_id, *args)
    monkeypatch.setattr(Marks, "put_back", end_lease_then_put_back)
    await client.kv.delete(registry.key("instances", INSTANCE), timeout=5)  # the operator's `etcdctl del`
    await eventually(lambda: registry.lease_id != old_lease and registry.is_registered, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id and registry.holds(DRAIN_MARKS, INSTANCE), "the self-drain was withdrawn"


async def test_a_self_drain_an_operator_deleted_while_the_records_were_put_back_stays_deleted(
        draining, cluster, monkeypatch) -> None:
    """The same moment with the lease alive and the mark deleted by an operator's Undrain: withdrawn, as before."""
    registry, client = draining
    old_lease, put_back = registry.lease_id, Marks.put_back
    mark = f"/ferry/{cluster}/{MARK}"

    async def undrain_then_put_back(marks: Marks, etcd: Etcd3Client, key: str, value, lease_id: int, *args):
        await client.kv.delete(mark, timeout=5)
        return await put_back(marks, etcd, key, value, lease_id, *args)
    monkeypatch.setattr(Marks, "put_back", undrain_then_put_back)
    await client.kv.delete(registry.key("instances", INSTANCE), timeout=5)
    await eventually(lambda: not registry.holds(DRAIN_MARKS, INSTANCE), what="the mark withdrawn")
    await eventually(lambda: registry.is_registered, what="registered")
    assert registry.lease_id == old_lease and not (await client.kv.get(mark, timeout=5)).kvs


async def _expire_while_frozen(registry: Registry, client: Etcd3Client, while_frozen=None) -> None:
    """The instance's keepalive held (its lock: no renewal, no read-back of its keys) until its 2 s lease has expired
    in etcd, `while_frozen` done first: as for an instance frozen, or cut off from etcd, in its last renewals."""
    lease_id = registry.lease_id
    async with registry._lock:
        if while_frozen is not None:
            await while_frozen()
        while (await client.lease.time_to_live(lease_id, timeout=5)).TTL != -1:  # 0: under a second left
            await asyncio.sleep(0.1)


async def test_an_undrain_no_renewal_saw_before_the_lease_expired_stands(draining, cluster) -> None:
    """An operator's Undrain of the self-drain mark in the last moments of the instance's lease, before a renewal read
    its keys back: the mark was gone when the lease expired either way, so the registry took the Undrain for the
    lease's doing and put the mark back, and the instance drained again. It now reads in etcd's history that the mark
    went while the lease still held the instance's record, and withdraws it."""
    registry, client = draining
    mark = f"/ferry/{cluster}/{MARK}"
    await _expire_while_frozen(registry, client, lambda: client.kv.delete(mark, timeout=5))  # the Undrain
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    record = (await client.kv.get(registry.key("instances", INSTANCE), timeout=5)).kvs
    assert record and record[0].lease == registry.lease_id
    assert not (await client.kv.get(mark, timeout=5)).kvs, "the operator's Undrain was undone"
    assert not registry.holds(DRAIN_MARKS, INSTANCE) and registry.is_registered


async def test_a_self_drain_that_expired_with_the_lease_while_frozen_is_put_back(draining, cluster) -> None:
    """The same freeze without an Undrain: the mark went with the lease and is put back under the new one."""
    registry, client = draining
    old_lease = registry.lease_id
    await _expire_while_frozen(registry, client)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id != old_lease and registry.holds(DRAIN_MARKS, INSTANCE)


async def test_a_self_drain_whose_history_was_compacted_is_put_back(draining, cluster) -> None:
    """Where etcd no longer holds the history (compacted: it keeps an hour) the registry cannot tell an Undrain from
    the lease's expiry: it puts the mark back, as before, rather than wait or fail its renewals."""
    registry, client = draining

    async def undrain_and_compact() -> None:
        reply = await client.kv.delete(f"/ferry/{cluster}/{MARK}", timeout=5)
        await client.kv.compact(reply.header.revision, physical=True, timeout=5)
    await _expire_while_frozen(registry, client, undrain_and_compact)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id and registry.is_registered


async def test_a_self_drain_the_instance_updated_then_lost_with_its_lease_is_put_back(draining, cluster) -> None:
    """The instance's own later put of its mark (under the same lease) is no one else's change: put back."""
    registry, client = draining
    await registry.update(DRAIN_MARKS, INSTANCE, {"instance_id": INSTANCE, "drained_by": "shutdown", "drained_at": 2.0})
    await _expire_while_frozen(registry, client)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    (kv,) = (await client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
    assert kv.lease == registry.lease_id and json.loads(kv.value)["drained_at"] == 2.0


async def test_an_operators_drain_then_undrain_no_renewal_saw_stands(draining, cluster) -> None:
    """An operator's Drain over the self-drain, then Undrain, both before a renewal read the mark back and the lease
    expired: the mark is the operator's decision, withdrawn, not put back."""
    registry, client = draining
    mark = f"/ferry/{cluster}/{MARK}"

    async def drain_and_undrain() -> None:
        await client.kv.put(mark, json.dumps({"instance_id": INSTANCE, "owner": "operator"}), timeout=5)
        await client.kv.delete(mark, timeout=5)
    await _expire_while_frozen(registry, client, drain_and_undrain)
    await eventually(lambda: registry.num_reregistrations == 1, what="re-registration")
    assert not (await client.kv.get(mark, timeout=5)).kvs and not registry.holds(DRAIN_MARKS, INSTANCE)


async def test_a_self_drain_right_after_a_freeze_past_the_lease_goes_under_a_new_lease(etcd, cluster) -> None:
    """SIGTERM handled the moment a process frozen past its lease TTL ran again: the self-drain mark was put under
    the lease etcd had ended, etcd refused it (`self_drain_failed`), and nothing moved its requests off before the
    grace cut them. A lease the local clock says may be gone is renewed, or replaced, before the mark is put."""
    registry = Registry([etcd.endpoint], cluster, ttl_s=2.0)
    try:
        await registry.register("instances", INSTANCE, {"address": "127.0.0.1:1"})
        old_lease = registry.lease_id
        time.sleep(3.0)  # the whole event loop frozen past the TTL: etcd ends the lease
        await drain_self(registry, INSTANCE)
        assert registry.holds(DRAIN_MARKS, INSTANCE), "the self-drain was lost with the ended lease"
        (kv,) = (await registry._client.kv.get(f"/ferry/{cluster}/{MARK}", timeout=5)).kvs
        assert kv.lease == registry.lease_id != old_lease and json.loads(kv.value)["drained_by"] == "shutdown"
        await eventually(lambda: registry.is_registered, what="registered again")
    finally:
        await registry.close()


async def test_a_self_drain_etcd_cannot_take_logs_the_error_as_text(running_etcd, cluster) -> None:
    """Before, `self_drain_failed` said "...: EtcdConnectionError('KV.Txn failed after 3 attempts: ...')" (the
    registry wrote the exception's repr): the message alone now, as every other log line has it (error_text)."""
    registry = Registry([running_etcd.endpoint], cluster, ttl_s=5.0)
    try:
        await registry.register("instances", INSTANCE, {"address": "127.0.0.1:1"})
        running_etcd.stop()
        with capture_logs() as logs:
            await drain_self(registry, INSTANCE)
        (error,) = [e["error"] for e in logs if e["event"] == "self_drain_failed"]
        assert "failed after" in error and "Error(" not in error, error
    finally:
        running_etcd.start()
        await registry.close()


async def test_an_operators_drain_landing_just_before_the_self_drain_is_kept(etcd, cluster, monkeypatch) -> None:
    """An operator's Drain that landed between the instance's look for a mark and its own put of one: the self-drain
    went over it, under the instance's lease, and the operator's Drain went with that lease when the instance
    stopped. The self-drain is now put only where no mark is, in one etcd transaction with that check."""
    registry = Registry([etcd.endpoint], cluster, ttl_s=2.0)
    mark = f"/ferry/{cluster}/{MARK}"
    operator_mark = json.dumps({"instance_id": INSTANCE, "drained_by": "m-1", "drained_at": 1.0, "owner": "operator"})
    try:
        await registry.register("instances", INSTANCE, {"address": "127.0.0.1:1"})
        async with Etcd3Client([etcd.endpoint]) as operator:
            _before_writes_of(registry._client.kv, mark, lambda: operator.kv.put(mark, operator_mark, timeout=5),
                              monkeypatch)
            await drain_self(registry, INSTANCE)
            assert not registry.holds(DRAIN_MARKS, INSTANCE)
            await registry.close()  # its lease goes: the operator's mark stays
            (kept,) = (await operator.kv.get(mark, timeout=5)).kvs
            assert kept.value.decode() == operator_mark and kept.lease == 0
    finally:
        await registry.close()


def _before_writes_of(kv, key: str, first, monkeypatch) -> None:
    """A hook: `first()` runs once, just before the first put of `key` through `kv` (a put, or a transaction's)."""
    originals = {"put": kv.put, "txn": kv.txn}

    def hooked(name: str):
        async def write(*args, **kwargs):
            ops = kwargs.get("success", ())
            if (args[0] == key) if name == "put" else any(op.request_put.key == key.encode() for op in ops):
                for original_name, original in originals.items():
                    monkeypatch.setattr(kv, original_name, original)
                await first()
            return await originals[name](*args, **kwargs)
        return write
    for name in originals:
        monkeypatch.setattr(kv, name, hooked(name))
