"""Drain and retirement races a review of the manager found (each failed before its fix): an instance
leaving while its Drain's mark was written, two call-offs of one retirement at once, "drained" said while a
migration out of the instance was still under way, and scaling across leader changes (silence seen in an
earlier term, a leader deposed mid-tick, an Undrain before a new term's first tick)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
import time

import pytest
from etcd3aio.errors import EtcdConnectionError
from structlog.testing import capture_logs

from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import common_pb2, manager_pb2
from services.common.scaling_target import ScalingTarget
from services.manager import convert
from services.manager.dispatcher import Dispatcher
from services.manager.domain import InstanceId
from services.manager.migration import MigrationSettings, MigrationTrigger
from services.manager.scaling import RETIRED_GONE_S, Scaler, ScalingSettings
from services.manager.server import AdminServicer
from tests.unit.manager.factories import FakeClock, make_load, make_view
from tests.unit.manager.test_control_plane_races import Ctx
from tests.unit.manager.test_migrator import FakeSources, cluster, make_migrator, report, routes, settle
from tests.unit.manager.test_scaling import BAND, FakeStore, leader

pytestmark = pytest.mark.timeout(20)


# 1. The instance's lease ended (it was killed) while its Drain waited for etcd to store the mark: the
#    answer read the instance from the view after the await and raised KeyError (INTERNAL, a traceback).
class DepartingStore(FakeStore):
    """etcd stores the mark; meanwhile the membership watch removes the instance (its lease ended)."""

    def __init__(self, view) -> None:
        super().__init__()
        self.view = view

    async def put_drain(self, instance_id) -> None:
        await asyncio.sleep(0)
        self.view.remove_member(InstanceId(instance_id))
        await super().put_drain(instance_id)


async def test_a_drain_of_an_instance_that_leaves_meanwhile_answers_without_its_state():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = DepartingStore(view)
    scaler = Scaler(view, leadership, store, ScalingSettings(), interval_s=1, cooldown_s=0, clock=clock)
    admin = AdminServicer(view, Dispatcher(view, leadership), leadership, store, None,
                          make_migrator(view, clock, FakeSources()), scaler, 1.0, 1.0, 1.0)
    answer = await admin.Drain(manager_pb2.DrainRequest(instance_id="i-1"), Ctx())
    assert answer.instance_id == "i-1" and not answer.is_drained
    assert answer.state == common_pb2.INSTANCE_STATE_UNSPECIFIED
    assert store.drained == {"i-1"} and view.has_drain_mark("i-1")  # a restart under its id comes back drained


# 2. Two call-offs of one retirement at once (an operator's Undrain sent twice, or an Undrain during the
#    tick that calls the retirement off for a burst): each passed its "still retiring?" check before the
#    other's etcd delete answered, and each gave the target one more instance: a launcher started one too many.
class SlowDeleteStore(FakeStore):
    async def delete_drain(self, instance_id) -> bool:
        await asyncio.sleep(0)  # etcd answers on a later turn of the event loop
        return await super().delete_drain(instance_id)


async def retiring_i2(store: FakeStore) -> tuple[FakeClock, Scaler]:
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"  # retiring: target 2
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=990, num_running=1))  # still draining
    return clock, scaler


async def test_two_undrains_of_a_retiring_instance_at_once_give_it_back_once():
    store = SlowDeleteStore()
    _, scaler = await retiring_i2(store)
    await asyncio.gather(scaler.call_off(InstanceId("i-2")), scaler.call_off(InstanceId("i-2")))
    assert store.target.num_instances == 3, f"target {store.target.num_instances}: i-2 was given back twice"
    assert store.target.draining == [] and store.drained == set()


async def test_an_undrain_during_a_burst_call_off_gives_the_instance_back_once():
    store = SlowDeleteStore()
    _, scaler = await retiring_i2(store)
    scaler._view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=50, num_running=9))  # the burst
    scaler._view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=50, num_running=9))
    await asyncio.gather(scaler.tick(), scaler.call_off(InstanceId("i-2")))
    assert store.target.num_instances == 3, f"target {store.target.num_instances}: i-2 was given back twice"


# 3. A drain's last request taken out of its source's batch for the stop-and-copy stage is in no queue there:
#    the source's report shows nothing running or waiting, and the instance was called drained (safe to
#    stop: scaling listed it stoppable) while the copy and the commit were under way; a commit that then
#    failed would resume the request on an instance being stopped.
async def test_an_instance_a_migration_moves_a_request_out_of_is_not_drained_yet():
    clock = FakeClock()
    view = cluster(clock, a=1, b=0)
    view.mark_drained(InstanceId("a"))
    sources = FakeSources()
    sources.gate = asyncio.Event()
    migrator = make_migrator(view, clock, sources, settings=MigrationSettings(is_enabled=False))
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.DRAIN)]
    await asyncio.sleep(0)  # MigrateOut a -> b in flight
    clock.advance(0.1)
    report(view, "a", 0)  # the request is suspended for its last stage: neither running nor waiting
    is_drained = view.instance(InstanceId("a")).is_drained
    sources.gate.set()
    await settle(migrator)
    assert not is_drained, "a was called drained (stoppable) while its last request was being moved out"
    clock.advance(0.1)
    report(view, "a", 0)
    assert view.instance(InstanceId("a")).is_drained  # committed: now it is


# 4. What the scaler saw in an earlier term (a retiring instance silent since then) was kept across the terms
#    it did not lead: the first tick of its next term, before any instance had reported to it (each is in its
#    grace, without a report), found the instance "silent" since that old time and listed it stoppable at once,
#    though it had recovered meanwhile and still held requests.
async def test_a_new_term_does_not_count_silence_seen_in_an_earlier_one():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = FakeStore()
    scaler = Scaler(view, leadership, store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-1"
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=990, num_running=1))
    clock.advance(10)
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=1000))
    assert await scaler.tick() is None  # i-1 silent (a hung step) for 10 s: still draining
    leadership.set_elected(False)  # another manager leads for two minutes; i-1 recovers and reports to it
    for _ in range(12):
        clock.advance(10)
        assert await scaler.tick() is None
    leadership.set_elected(True)
    view.start_leading()  # (the campaign's takeover): every member gets a fresh grace to report
    assert await scaler.tick() is None
    assert store.target.draining == ["i-1"] and store.target.stoppable == [], (
        f"i-1 listed stoppable on the new term's first tick, before it could report: {store.target}")


# 5. A leader deposed in the middle of a scaling tick (its lease lost while it waited on etcd): the fenced
#    write refused, as it should, but the refusal ended the tick with a `periodic_step_failed` traceback,
#    which reads as a bug; a tick that finds etcd away is skipped with a warning, and so is this one.
class DeposedStore(FakeStore):
    async def put_drain(self, instance_id) -> None:
        raise Unavailable(f"drain mark of {instance_id} not written: the leader key is no longer this manager's "
                          "(epoch 7); another manager leads")


async def test_a_leader_deposed_mid_tick_skips_the_tick_with_a_warning():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = DeposedStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    with capture_logs() as logs:
        assert await scaler.tick() is None
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == ["scaling_tick_skipped"]
    assert store.drained == set() and not view.has_drain_mark("i-1")


# 6. An Undrain reaching a manager that leads again, before its first scaling tick of the new term read the
#    target: it called off a retirement of the target it kept from its earlier term and wrote that stale target
#    over the one another leader wrote meanwhile, erasing the retirement that leader had started (its instance
#    kept its drain mark, in no list: drained for good, and scaling held back by it for good).
async def test_an_undrain_right_after_a_re_election_calls_off_against_the_current_target():
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = FakeStore()
    scaler = Scaler(view, leadership, store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"
    leadership.set_elected(False)
    assert await scaler.tick() is None
    # Another leader's term: i-2's retirement called off by a burst, later i-1 retired.
    store.target = ScalingTarget(2, draining=["i-1"], reason="the other leader retires i-1", manager_id="m-2",
                                 updated_at=time.time())
    store.drained = {"i-1"}
    view.replace_drained(["i-1"])
    leadership.set_elected(True)  # leading again; its first scaling tick has not run yet
    await scaler.call_off(InstanceId("i-2"))  # an operator's Undrain of i-2 (serving already)
    assert store.target.draining == ["i-1"] and store.target.num_instances == 2, (
        f"the other leader's retirement of i-1 was written over: {store.target}")


class CountingReadsStore(FakeStore):
    def __init__(self, target: ScalingTarget) -> None:
        super().__init__(target)
        self.num_reads = 0

    async def get_scaling_target(self):
        self.num_reads += 1
        await asyncio.sleep(0)
        return await super().get_scaling_target()


async def test_a_tick_and_an_undrain_at_a_terms_start_read_the_target_once():
    """Both read it: the later read replaced the target the tick was changing with a copy from before."""
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    view.mark_drained(InstanceId("i-2"))
    store = CountingReadsStore(ScalingTarget(2, draining=["i-2"], reason="retire", manager_id="m-0",
                                             updated_at=time.time() - 100))
    store.drained = {"i-2"}
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    await asyncio.gather(scaler.tick(), scaler.call_off(InstanceId("i-0")))
    assert store.num_reads == 1
    assert scaler._target is not None and scaler._target.stoppable == ["i-2"] == store.target.stoppable


# 10. Requests the manager's own bookkeeping cannot see: one a previous leader's migration suspended for its last
#     stage (no migration of ours moves it), or one parked on a prefill instance for its PD hand-off (the instance
#     runs those itself). Neither is running nor waiting, so the instance was called drained, and an operator who
#     stopped it then lost the request. The instance now counts them in its report (num_suspended).
@pytest.mark.parametrize("how", ["a previous leader's migration", "a PD hand-off"])
async def test_an_instance_holding_a_suspended_request_is_not_drained(how):
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = FakeStore()
    scaler = Scaler(view, leadership, store, ScalingSettings(), interval_s=1, cooldown_s=0, clock=clock)
    admin = AdminServicer(view, Dispatcher(view, leadership), leadership, store, None,
                          make_migrator(view, clock, FakeSources()), scaler, 1.0, 1.0, 1.0)
    report = common_pb2.LoadReport(instance_id="i-1", num_free_blocks=990, num_total_blocks=1000, num_suspended=1)
    view.apply_report(InstanceId("i-1"), convert.load_from_proto(report))
    answer = await admin.Drain(manager_pb2.DrainRequest(instance_id="i-1"), Ctx())
    assert not answer.is_drained and answer.num_remaining == 1, f"called drained while it holds {how}'s request"
    clock.advance(0.1)
    view.apply_report(InstanceId("i-1"), convert.load_from_proto(common_pb2.LoadReport(
        instance_id="i-1", num_free_blocks=1000, num_total_blocks=1000)))  # moved: gone from here
    answer = await admin.Drain(manager_pb2.DrainRequest(instance_id="i-1"), Ctx())
    assert answer.is_drained and answer.num_remaining == 0


# 11. A retiring instance's lease blip (its lease expired and it registered again at once, as after a short etcd
#     outage or freeze): the tick that ran while its key was gone took it for retired and gone, deleted its drain
#     mark and dropped it from the target, so it came back serving and its retirement began again from the start
#     (a later tick, a cooldown later). It continues: only an instance gone for RETIRED_GONE_S is forgotten.
async def test_a_retiring_instances_lease_blip_does_not_restart_its_retirement():
    store = FakeStore()
    clock, scaler = await retiring_i2(store)
    view = scaler._view
    record = view.record(InstanceId("i-2"))
    view.remove_member(InstanceId("i-2"))  # its lease expired ...
    clock.advance(1)
    await scaler.tick()
    view.put_member(record)  # ... and it registered again at once
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=990, num_running=1))
    clock.advance(1)
    assert await scaler.tick() is None
    assert store.forgotten == [] and store.drained == {"i-2"}, "the blip ended i-2's retirement (mark deleted)"
    assert store.target.draining == ["i-2"] and store.target.num_instances == 2
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=1000))  # its last request moved off
    clock.advance(1)
    await scaler.tick()
    assert store.target.stoppable == ["i-2"]  # the same retirement, carried on
    view.remove_member(InstanceId("i-2"))  # the launcher stopped it: gone for good
    for _ in range(int(RETIRED_GONE_S) + 1):
        clock.advance(1)
        await scaler.tick()
    assert store.forgotten == ["i-2"] and store.target.stoppable == [] and store.drained == set()


# 12. Two scaler writes of the target at once (a tick's and an Undrain's call-off) shared one "unwritten" flag: the
#     newer write failed, the older one then succeeded and cleared the flag, so etcd kept the older target (without
#     the call-off) until the next scaling action. Writes now go one at a time, and the flag is the last one's.
class OverlappingWritesStore(FakeStore):
    """The first target write is slow and lands; the second one (started meanwhile) fails."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = asyncio.Event()
        self.num_calls = 0

    async def put_scaling_target(self, target: ScalingTarget) -> None:
        self.num_calls += 1
        if self.num_calls == 1:
            written = copy.deepcopy(target)  # what went on the wire: serialized when sent
            await self.slow.wait()
            self.target = written
            return
        if self.num_calls == 2:
            raise EtcdConnectionError("KV.Txn failed: UNAVAILABLE")
        await super().put_scaling_target(target)


async def test_a_failed_write_overlapping_an_older_one_that_lands_is_written_again():
    store = FakeStore()
    clock, scaler = await retiring_i2(store)
    overlapping = OverlappingWritesStore()
    overlapping.target, overlapping.drained = store.target, store.drained
    scaler._store = overlapping
    scaler._cooldown_s = 30  # no new scaling action rewrites the target meanwhile
    first = asyncio.create_task(scaler._write(scaler._target))  # e.g. a tick's rewrite of the target
    await asyncio.sleep(0)
    undrain = asyncio.create_task(scaler.call_off(InstanceId("i-2")))  # target 3, sent while the first waits
    await asyncio.sleep(0)
    overlapping.slow.set()
    await first
    with pytest.raises(EtcdConnectionError):
        await undrain
    clock.advance(1)
    await scaler.tick()
    assert overlapping.target.num_instances == 3 and overlapping.target.draining == [], (
        f"etcd kept the target from before the call-off: {overlapping.target}")


# 13. A re-election inside one scaling tick (this manager lost its lease while the tick waited on etcd, another
#     manager led for a moment, and this one won again before the next tick): no tick saw it not leading, so the
#     stored target was never read again and the next term acted on the one kept from the earlier term, writing it
#     over what the other leader wrote. A new term (counted by Leadership) reads the stored target again.
class ReElectedMidTickStore(FakeStore):
    def __init__(self, leadership) -> None:
        super().__init__()
        self.leadership = leadership
        self.re_elect = False

    async def put_drain(self, instance_id) -> None:
        await super().put_drain(instance_id)
        if self.re_elect:
            self.re_elect = False
            self.leadership.set_elected(False)  # deposed while etcd answered ...
            self.target = ScalingTarget(3, reason="the other leader called it off", manager_id="m-2",
                                        updated_at=time.time())
            self.drained.discard(instance_id)
            self.leadership.set_elected(True)  # ... and elected again before the next tick


async def test_a_re_election_inside_a_tick_reads_the_stored_target_again():
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = ReElectedMidTickStore(leadership)
    scaler = Scaler(view, leadership, store, BAND, interval_s=1, cooldown_s=30, clock=clock)
    store.re_elect = True
    with contextlib.suppress(Unavailable):
        await scaler.tick()  # retires i-2; the other leader's term passes while its drain mark is written
    view.unmark_drained(InstanceId("i-2"))
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=990, num_running=1))
    clock.advance(1)
    await scaler.tick()
    assert store.target.num_instances == 3 and store.target.draining == [], (
        f"the earlier term's target was written over the stored one: {store.target}")


# 7. etcd frozen (SIGSTOP) during a Drain, Undrain or SetPolicy: the put timed out with a TimeoutError whose text is
#    empty, and the answer said "etcd did not store the mark (); retry": an exception is always truthy, so
#    `exc or type(exc).__name__` never fell back to the name.
class TimingOutStore(FakeStore):
    async def put_drain(self, instance_id) -> None:
        raise TimeoutError()

    async def delete_drain(self, instance_id) -> bool:
        raise TimeoutError()

    async def update_policy(self, merge):
        raise TimeoutError()


async def test_an_etcd_timeout_is_named_in_the_answer():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    leadership, store = leader(), TimingOutStore()
    scaler = Scaler(view, leadership, store, ScalingSettings(), interval_s=1, cooldown_s=0, clock=clock)
    admin = AdminServicer(view, Dispatcher(view, leadership), leadership, store, None,
                          make_migrator(view, clock, FakeSources()), scaler, 1.0, 1.0, 1.0)
    calls = ((admin.Drain, manager_pb2.DrainRequest(instance_id="i-1"), "etcd did not store the mark (TimeoutError)"),
             (admin.Undrain, manager_pb2.UndrainRequest(instance_id="i-1"), "etcd did not delete the mark (TimeoutError)"),
             (admin.SetPolicy, manager_pb2.Policy(dispatch="load"), "etcd did not store it (TimeoutError)"))
    for rpc, request, message in calls:
        with pytest.raises(Unavailable, match=re.escape(message)):
            await rpc(request, Ctx())


# 8. Two SetPolicy calls at once, each a partial change: etcd stored both merges in turn (compare-and-put), but the
#    call stored first came back from etcd last and applied its merge here over the later one's: GetPolicy said
#    the later call's field was never set, until the config watch applied what was stored (seen in CI).
class FirstAnswerLateStore(FakeStore):
    """Stores each merge at once, in call order; the first call's answer waits (up to 0.2 s) for another's."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = (None, None, None)
        self.num_calls = 0
        self.another_answered = asyncio.Event()

    async def update_policy(self, merge):
        self.num_calls += 1
        is_first = self.num_calls == 1
        self.stored = merged = merge(*self.stored)
        if is_first:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.another_answered.wait(), 0.2)
        else:
            self.another_answered.set()
        return merged


async def test_partial_policy_changes_at_once_are_applied_in_the_order_stored():
    clock = FakeClock()
    view = make_view("i-0", clock=clock, num_free_blocks=1000)
    leadership, store = leader(), FirstAnswerLateStore()
    scaler = Scaler(view, leadership, store, ScalingSettings(), interval_s=1, cooldown_s=0, clock=clock)
    admin = AdminServicer(view, Dispatcher(view, leadership), leadership, store, None,
                          make_migrator(view, clock, FakeSources()), scaler, 1.0, 1.0, 1.0)
    await asyncio.gather(admin.SetPolicy(manager_pb2.Policy(dispatch="flood"), Ctx()),
                         admin.SetPolicy(manager_pb2.Policy(migration_threshold=3.5), Ctx()))
    policy = await admin.GetPolicy(manager_pb2.GetPolicyRequest(), Ctx())
    assert (policy.dispatch, policy.migration_threshold) == ("flood", 3.5)
