"""The scaler's etcd writes land only while its manager's leader key stands (real etcd): a leader
deposed between two awaits, still acting on its old epoch, writes nothing over its successor's."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from etcd3aio import Etcd3Client

from services.common.election import Election
from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import manager_pb2
from services.common.scaling_target import ScalingTarget
from services.manager.config_store import ConfigStore, DrainOwner, drain_owner
from services.manager.dispatcher import Dispatcher
from services.manager.domain import InstanceId
from services.manager.leadership import Leadership
from services.manager.scaling import Scaler
from services.manager.server import AdminServicer
from tests.unit.manager.factories import FakeClock, make_load, make_view
from tests.unit.manager.test_control_plane_races import Ctx
from tests.unit.manager.test_migrator import FakeSources, make_migrator
from tests.unit.manager.test_scaling import BAND

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(etcd):
    async with Etcd3Client([etcd.endpoint]) as etcd_client:
        yield etcd_client


async def test_a_deposed_leader_writes_no_target_and_no_drain_mark(etcd, cluster, client):
    old = Election([etcd.endpoint], cluster, "m-old", "127.0.0.1:1001", ttl_s=2.0)
    new = Election([etcd.endpoint], cluster, "m-new", "127.0.0.1:1002", ttl_s=2.0)
    try:
        await asyncio.wait_for(old.campaign(), 5)
        old_epoch = old.epoch
        stale = ConfigStore(client, cluster, "m-old").fenced_by(old.key, lambda: old_epoch)
        await stale.put_scaling_target(ScalingTarget(3, reason="while leading"))
        await stale.put_drain(InstanceId("i-1"))
        assert (await stale.get_scaling_target()).num_instances == 3

        await client.kv.delete(old.key)  # its lease ran out while it waited: another manager wins
        await asyncio.wait_for(new.campaign(), 5)
        with pytest.raises(Unavailable, match="no longer this manager's"):
            await stale.put_scaling_target(ScalingTarget(1, reason="stale"))
        with pytest.raises(Unavailable, match="no longer this manager's"):
            await stale.delete_drain(InstanceId("i-1"))
        with pytest.raises(Unavailable, match="no longer this manager's"):
            await stale.put_drain(InstanceId("i-2"))
        with pytest.raises(Unavailable, match="no longer this manager's"):
            await stale.forget_retired(InstanceId("i-1"))

        current = ConfigStore(client, cluster, "m-new").fenced_by(new.key, lambda: new.epoch)
        assert (await current.get_scaling_target()).num_instances == 3
        settings, _ = await ConfigStore(client, cluster, "m-new").read()
        assert settings.drained == {"i-1"}
        await current.put_scaling_target(ScalingTarget(4, reason="new leader"))
        assert (await current.get_scaling_target()).num_instances == 4
    finally:
        await old.close()
        await new.close()


async def test_a_manager_that_does_not_lead_writes_nothing(etcd, cluster, client):
    store = ConfigStore(client, cluster, "m-x").fenced_by(f"/ferry/{cluster}/leader/x", lambda: None)
    with pytest.raises(Unavailable, match="does not lead now"):
        await store.put_scaling_target(ScalingTarget(2))
    assert await store.get_scaling_target() is None


async def test_a_retired_instance_leaves_neither_drain_mark_nor_role_mark(etcd, cluster, client):
    election = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=2.0)
    try:
        await asyncio.wait_for(election.campaign(), 5)
        store = ConfigStore(client, cluster, "m-a")
        await store.fenced_by(election.key, lambda: election.epoch).put_drain(InstanceId("i-3"))
        await client.kv.put(store.role_key(InstanceId("i-3")), '{"role": "prefill", "command_line_role": "both"}')
        await store.fenced_by(election.key, lambda: election.epoch).forget_retired(InstanceId("i-3"))
        assert not (await client.kv.get(store.drain_key(InstanceId("i-3")))).kvs
        assert not (await client.kv.get(store.role_key(InstanceId("i-3")))).kvs
    finally:
        await election.close()


async def test_a_retired_instance_keeps_an_operators_drain_mark(etcd, cluster, client):
    """An operator drained an instance scaling was retiring; once it had left, the leader deleted every drain
    mark of it, the operator's included, so a later instance under its id served. Only the scaler's mark (or an
    ownerless one) goes now; the role mark goes either way."""
    election = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=2.0)
    try:
        await asyncio.wait_for(election.campaign(), 5)
        store = ConfigStore(client, cluster, "m-a")
        fenced = store.fenced_by(election.key, lambda: election.epoch)
        for instance_id in ("i-3", "i-4"):
            await client.kv.put(store.role_key(InstanceId(instance_id)), '{"role": "prefill"}')
        await store.put_drain(InstanceId("i-3"))  # the operator's Drain
        await fenced.put_drain(InstanceId("i-4"))  # the scaler's
        await fenced.forget_retired(InstanceId("i-3"))
        await fenced.forget_retired(InstanceId("i-4"))
        (mark,) = (await client.kv.get(store.drain_key(InstanceId("i-3")))).kvs
        assert drain_owner(mark.value) is DrainOwner.OPERATOR
        assert not (await client.kv.get(store.drain_key(InstanceId("i-4")))).kvs
        for instance_id in ("i-3", "i-4"):
            assert not (await client.kv.get(store.role_key(InstanceId(instance_id)))).kvs
        await fenced.forget_retired(InstanceId("i-5"))  # no marks at all: nothing to do, no error
    finally:
        await election.close()


async def test_a_burst_calls_off_a_retirement_but_keeps_an_operators_drain_of_it(etcd, cluster, client):
    """An operator drained an instance scaling was retiring; a burst then called the retirement off and deleted the
    drain mark, the operator's with it: the instance served again. Marks record their owner now, and a call-off
    deletes only the scaler's (or an ownerless one, written before owners were recorded)."""
    election = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=2.0)
    try:
        await asyncio.wait_for(election.campaign(), 5)
        clock = FakeClock()
        view = make_view("i-0", "i-1", "i-2", "i-3", clock=clock, num_free_blocks=1000)
        leadership = Leadership("m-a", "127.0.0.1:1001")
        leadership.set_elected(True)
        store = ConfigStore(client, cluster, "m-a")
        scaler = Scaler(view, leadership, store.fenced_by(election.key, lambda: election.epoch),
                        dataclasses.replace(BAND, max_instances=4), interval_s=1, cooldown_s=0, clock=clock)
        admin = AdminServicer(view, Dispatcher(view, leadership), leadership, store, None,
                              make_migrator(view, clock, FakeSources()), scaler, 1.0, 1.0, 1.0)
        assert (await scaler.tick()).instance_id == "i-3"  # retiring: the scaler's mark
        view.apply_report(InstanceId("i-3"), make_load(num_free_blocks=990, num_running=1))  # still draining
        await admin.Drain(manager_pb2.DrainRequest(instance_id="i-3"), Ctx())  # the operator's mark
        old_mark = {"instance_id": "i-2", "drained_by": "m-0", "drained_at": 1.0}  # a predecessor's, no owner
        await client.kv.put(store.drain_key(InstanceId("i-2")), json.dumps(old_mark))
        view.mark_drained(InstanceId("i-2"))
        scaler._target.draining.append(InstanceId("i-2"))
        for instance_id in ("i-0", "i-1"):  # the burst
            view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=50, num_running=9))
        clock.advance(1)
        await scaler.tick()
        assert scaler._target.draining == [] and "called off" in scaler._target.reason
        settings, _ = await store.read()
        assert settings.drained == {"i-3"}, f"drain marks left: {sorted(settings.drained)}"
        assert view.has_drain_mark("i-3") and not view.has_drain_mark("i-2")
        await admin.Undrain(manager_pb2.UndrainRequest(instance_id="i-3"), Ctx())  # the operator's own undo
        assert (await store.read())[0].drained == frozenset()
    finally:
        await election.close()


async def test_the_scalers_drain_mark_never_overwrites_an_operators(etcd, cluster, client):
    """An operator's Drain that landed while a tick waited to mark the instance it had chosen to retire: the
    scaler's put wrote its own mark over the operator's, so a burst's call-off then deleted it and the instance
    served again, as if never drained. The scaler now marks only an instance without a mark."""
    election = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=2.0)
    try:
        await asyncio.wait_for(election.campaign(), 5)
        store = ConfigStore(client, cluster, "m-a")
        fenced = store.fenced_by(election.key, lambda: election.epoch)
        await store.put_drain(InstanceId("i-3"))  # the operator's Drain, just before the tick's write
        await fenced.put_drain(InstanceId("i-3"))
        (mark,) = (await client.kv.get(store.drain_key(InstanceId("i-3")))).kvs
        assert drain_owner(mark.value) is DrainOwner.OPERATOR
        assert not await fenced.delete_drain(InstanceId("i-3"))  # a call-off keeps it
        await fenced.put_drain(InstanceId("i-4"))  # no mark there: the scaler's
        (mark,) = (await client.kv.get(store.drain_key(InstanceId("i-4")))).kvs
        assert drain_owner(mark.value) is DrainOwner.SCALER
    finally:
        await election.close()
