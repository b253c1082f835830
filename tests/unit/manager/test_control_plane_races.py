"""Control-plane races and leaks a code review found: a drain stuck on a refusing destination, scaling
frozen by a failed write or a vanished drain mark, "drained" said too early or from a stale report, a new
leader ignoring its predecessor's cooldown, per-request and per-id state kept for ever."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.common.gen.ferry.v1 import common_pb2, manager_pb2
from services.common.scaling_target import ScalingTarget
from services.manager.cluster_view import ClusterView
from services.manager.dispatcher import Dispatcher
from services.manager.domain import InstanceId, InstanceState
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationSelection, MigrationSettings, MigrationTrigger)
from services.manager.scaling import Scaler, ScalingAction, ScalingSettings
from services.manager.server import AdminServicer, ManagerServicer
from tests.unit.manager.factories import FakeClock, make_load, make_record, make_view
from tests.unit.manager.test_migrator import FakeSources, cluster, make_migrator, report, settle
from tests.unit.manager.test_scaling import BAND, FakeStore, leader

FAILOVER_BAND = ScalingSettings(is_enabled=True, low_freeness=60.0, high_freeness=1000.0, min_instances=1,
                                max_instances=5)

pytestmark = pytest.mark.timeout(60)  # 20 s: the 5000-request test took 5.1 s of it at load 20


# 1. Migrator._cooled grows by one entry per committed PD hand-off for ever while the load loop is off.
async def test_cooled_request_ids_are_forgotten_even_with_the_load_loop_off():
    clock = FakeClock()
    view = cluster(clock, p=0, d=0)
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False),
                             cooldown_s=10.0)
    for n in range(5000):  # the PD push of 5000 requests, reported by the prefill instance
        order = MigrationOrder(InstanceId("p"), "a", InstanceId("d"), "b", MigrationTrigger.PD,
                               MigrationSelection.PREFILL_DONE, request_id=f"r-{n}", max_stages=0)
        migrator.keep_reported(MigrationRecord(order, MigrationOutcome.COMMITTED, MigrationFigures(f"r-{n}"), 1.0))
        clock.advance(1.0)
        migrator.tick()  # the loop keeps ticking (drains, PD healing), load-balancing off
    await settle(migrator)
    assert len(migrator._pacing._cooled) <= 20, f"{len(migrator._pacing._cooled)} request ids kept for a 10 s cooldown"


# 2. A destination that keeps refusing (batch slots full, blocks free) stalls a drain for ever:
#    the backed-off pair is dropped after pairing, the next-freest destination is never tried.
async def test_a_drain_tries_another_destination_when_the_freest_one_keeps_refusing():
    clock = FakeClock()
    view = cluster(clock, a=5, b=0, c=1)  # b freest, c next
    view.mark_drained(InstanceId("a"))
    refusals = [ResourceExhausted("destination b: no free batch slot") for _ in range(50)]

    class RefusingB(FakeSources):
        async def migrate_out(self, order, timeout_s, on_picked):
            self.orders.append(order)
            if order.dst_instance_id == "b":
                raise refusals.pop(0)
            return MigrationFigures(f"r-{len(self.orders)}", num_blocks=4)

    sources = RefusingB()
    migrator = make_migrator(view, clock, sources, failure_backoff_s=2.0)
    for _ in range(20):  # 20 s of ticks, a fresh report from every instance each second
        migrator.tick()
        await settle(migrator)
        clock.advance(1.0)
        report(view, "a", 5)
        report(view, "b", 0)
        report(view, "c", 1)
    dsts = {o.dst_instance_id for o in sources.orders}
    assert "c" in dsts, f"drain only ever tried {dsts} ({len(sources.orders)} refused tries)"


# 3. A new leader ignores the cooldown of its predecessor's last action (it starts at -inf).
async def test_a_new_leader_keeps_the_cooldown_of_its_predecessors_last_action():
    clock = FakeClock()
    # The predecessor asked for a 3rd instance a second ago; it registered and reported (empty).
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=50, num_running=9)
    view.put_member(make_record("i-2"))
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=1000))
    store = FakeStore(ScalingTarget(3, reason="below the band", manager_id="m-0", updated_at=time.time() - 1))
    band = ScalingSettings(is_enabled=True, low_freeness=60.0, high_freeness=1000.0, min_instances=1,
                           max_instances=5)
    scaler = Scaler(view, leader(), store, band, interval_s=1, cooldown_s=60, clock=clock)
    decision = await scaler.tick()
    assert decision is None, f"new leader acted 1 s after its predecessor's action: {decision}"


# 5. A retiring instance whose drain mark goes by another way than Scaler.call_off (Undrain answered by a
#    standby whose leader did not answer in time: call_off is a no-op there) blocks scaling for good.
async def test_scaling_is_not_blocked_for_good_by_a_retirement_whose_drain_mark_went():
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"  # i-2 drains
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=990, num_running=1))  # still busy
    # Undrain on a standby: its scaler is not leading -> call_off returns; it deletes the mark in etcd;
    # the leader's config watch then unmarks it.
    await store.delete_drain(InstanceId("i-2"))
    view.unmark_drained(InstanceId("i-2"))
    decisions = []
    for _ in range(30):  # 5 min of an idle cluster, far above the band: the leader should retire one
        clock.advance(10)
        for i in ("i-0", "i-1", "i-2"):
            view.apply_report(InstanceId(i), make_load(num_free_blocks=1000))
        decisions.append(await scaler.tick())
    assert any(d is not None for d in decisions), f"scaling frozen; target {store.target}"


# 6. Drain/scaling say "drained" while a migration INTO the instance is still in flight.
async def test_an_instance_receiving_a_migration_is_not_drained_yet():
    clock = FakeClock()
    view = cluster(clock, a=4, b=0)
    sources = FakeSources()
    sources.gate = asyncio.Event()
    migrator = make_migrator(view, clock, sources)
    assert [(o.src_instance_id, o.dst_instance_id) for o in migrator.tick()] == [("a", "b")]
    await asyncio.sleep(0)  # MigrateOut a -> b in flight (b holds a reservation, not yet the request)
    view.mark_drained(InstanceId("b"))  # operator's Drain, or a scaling retirement of the idlest instance
    clock.advance(0.1)
    report(view, "b", 0)
    is_drained = view.instance(InstanceId("b")).is_drained
    sources.gate.set()
    await settle(migrator)
    assert not is_drained, "b reported drained (stoppable) while a migration into it was about to commit"


# 7. A scaling action whose target write fails after the drain mark was put is applied partially.
class FlakyTargetStore(FakeStore):
    def __init__(self, failures: int = 1):
        super().__init__()
        self.failures = failures

    async def put_scaling_target(self, target):
        if self.failures:
            self.failures -= 1
            raise TimeoutError("etcd slow")
        await super().put_scaling_target(target)


async def test_a_retirement_whose_target_write_failed_is_not_left_draining_for_good():
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    store = FlakyTargetStore(failures=1)
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert await scaler.tick() is None  # etcd unreachable: the tick is skipped (scaling_tick_skipped)
    assert store.drained == {"i-2"}  # the drain mark went to etcd; the target did not
    for _ in range(30):
        clock.advance(10)
        for i in ("i-0", "i-1", "i-2"):
            view.apply_report(InstanceId(i), make_load(num_free_blocks=1000))
        await scaler.tick()
    assert store.target is not None and (store.target.stoppable or store.drained == set()), (
        f"i-2 drained for good, never listed stoppable; target={store.target} drained={store.drained}")


async def test_a_stoppable_transition_whose_write_failed_is_written_again():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = FlakyTargetStore(failures=0)
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-1"
    store.failures = 1
    assert await scaler.tick() is None  # i-1 empty: draining -> stoppable, but the write fails (skipped)
    for _ in range(10):
        clock.advance(1)
        await scaler.tick()
    assert store.target.stoppable == ["i-1"], f"etcd still says {store.target}: no launcher will stop i-1"


# 8. A former leader (now standby) answers Drain from load reports of its old term: is_drained from a stale report.
class Ctx:
    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"


async def test_a_standby_does_not_call_an_instance_drained_from_a_report_of_its_old_term():
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)  # reported empty while we led
    leadership = leader()
    dispatcher = Dispatcher(view, leadership)
    migrator = make_migrator(view, clock, FakeSources())
    store = FakeStore()
    scaler = Scaler(view, leadership, store, ScalingSettings(), interval_s=1, cooldown_s=0, clock=clock)
    admin = AdminServicer(view, dispatcher, leadership, store, None, migrator, scaler, 1.0, 1.0, 1.0)
    leadership.set_elected(False)  # lost the lease; another manager leads (its key not seen yet / not answering)
    clock.advance(600)  # ten minutes on: i-1 now runs requests the new leader sent it
    answer = await admin.Drain(manager_pb2.DrainRequest(instance_id="i-1"), Ctx())
    assert not answer.is_drained, f"standby says drained from a 600 s old report: {answer}"


# 9. Load reports under ids that are not (or no longer) members are kept for ever.
def test_reports_of_non_members_are_not_kept_for_ever():
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for n in range(10000):  # ReportLoad is not behind the admin token: any id is accepted
        view.apply_report(InstanceId(f"ghost-{n}"), make_load())
    view.replace_members([])
    assert len(view._reports) == 0, f"{len(view._reports)} reports of ids never registered"


async def test_failover_right_after_a_retired_instance_was_stopped_does_not_block_scaling_for_minutes():
    """The predecessor listed i-2 stoppable (written 5 s ago); the launcher stopped it before the predecessor
    saw it go. The new leader waits out the predecessor's cooldown, not for an instance nobody asked for."""
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=50, num_running=9)  # freeness 5: below the band
    store = FakeStore(ScalingTarget(2, stoppable=["i-2"], reason="retire", manager_id="m-0",
                                    updated_at=time.time() - 5))
    scaler = Scaler(view, leader(), store, FAILOVER_BAND, interval_s=1, cooldown_s=60, clock=clock)
    decisions = []
    for _ in range(24):  # 4 minutes of ticks every 10 s, load below the band the whole time
        decisions.append(await scaler.tick())
        clock.advance(10)
        for i in ("i-0", "i-1"):
            view.apply_report(InstanceId(i), make_load(num_free_blocks=50, num_running=9))
    adds = [n for n, d in enumerate(decisions) if d is not None and d.action is ScalingAction.ADD]
    assert adds and adds[0] * 10 <= 70, (f"first ADD only after {adds[0] * 10 if adds else '>240'} s "
                                         f"(cooldown 60 s); _adding={scaler._adding}")


def retiring_i2(clock: FakeClock) -> tuple[ClusterView, FakeStore]:
    """Three instances, i-2 drained and its retirement (target 2) under way since a second ago."""
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    view.mark_drained(InstanceId("i-2"))
    store = FakeStore(ScalingTarget(2, draining=["i-2"], reason="retire", manager_id="m-0",
                                    updated_at=time.time() - 1))
    store.drained = {"i-2"}
    return view, store


async def test_failover_during_a_retirement_does_not_block_scaling_after_it_completes():
    """Same with i-2 still draining at the failover: once it drained and its launcher stopped it, the
    new leader scales again after the cooldown."""
    clock = FakeClock()
    view, store = retiring_i2(clock)
    scaler = Scaler(view, leader(), store, FAILOVER_BAND, interval_s=1, cooldown_s=60, clock=clock)
    await scaler.tick()  # i-2 empty and heard: stoppable
    assert store.target.stoppable == ["i-2"]
    view.remove_member(InstanceId("i-2"))  # the launcher stopped it
    decisions = []
    for _ in range(24):
        clock.advance(10)
        for i in ("i-0", "i-1"):
            view.apply_report(InstanceId(i), make_load(num_free_blocks=50, num_running=9))  # burst
        decisions.append(await scaler.tick())
    adds = [n for n, d in enumerate(decisions) if d is not None and d.action is ScalingAction.ADD]
    assert adds and adds[0] * 10 <= 70, (f"first ADD after {(adds[0] + 1) * 10 if adds else '>240'} s; "
                                         f"_adding={scaler._adding}")


# 10. A report stream whose last report came while the instance was no member (its lease was lost, not yet
#     registered again) left the stream's last-heard time unset: when the instance registered again and
#     died before its next report, the end of its stream did not mark it unhealthy (up to the report timeout).
async def _report_then(servicer: ManagerServicer, instance_id: str, between) -> None:
    async def reports():
        yield common_pb2.LoadReport(instance_id=instance_id, num_free_blocks=1000, num_total_blocks=1000)
        between()
    await servicer.ReportLoad(reports(), Ctx())


async def test_a_stream_ended_after_a_report_as_a_non_member_marks_the_instance_registered_since():
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    servicer = ManagerServicer(Dispatcher(view, leader()), view, leader())

    def registers_again():
        clock.advance(0.2)
        view.put_member(make_record("i-1"))  # re-registered under a new lease, then killed

    await _report_then(servicer, "i-1", registers_again)
    assert view.state_of(InstanceId("i-1")) is InstanceState.UNHEALTHY

    view.remove_member(InstanceId("i-1"))  # a member that reported, lost its lease, reported, came back
    view.put_member(make_record("i-1"))
    view.apply_report(InstanceId("i-1"), make_load())

    def loses_lease_and_registers_again():
        view.remove_member(InstanceId("i-1"))
        clock.advance(0.2)
        view.put_member(make_record("i-1"))

    await _report_then(servicer, "i-1", loses_lease_and_registers_again)
    assert view.state_of(InstanceId("i-1")) is InstanceState.UNHEALTHY


async def test_a_stream_ended_after_its_replacement_reported_does_not_mark_the_instance():
    clock = FakeClock()
    view = make_view("i-1", clock=clock)
    servicer = ManagerServicer(Dispatcher(view, leader()), view, leader())

    def replacement_reports():
        clock.advance(0.2)
        view.apply_report(InstanceId("i-1"), make_load())

    await _report_then(servicer, "i-1", replacement_reports)
    assert view.state_of(InstanceId("i-1")) is InstanceState.SERVING
    await _report_then(servicer, "i-1", lambda: None)
    assert view.state_of(InstanceId("i-1")) is InstanceState.UNHEALTHY


# 11. Migrator._failed_at kept a (src, dst) pair's failure for as long as both stayed members, its backoff long
#     over, unless that very pair was considered again: up to one entry per pair of members.
async def test_failed_pairs_are_forgotten_once_their_backoff_is_over():
    clock = FakeClock()
    ids = [f"i-{n}" for n in range(12)]
    view = cluster(clock, **dict.fromkeys(ids, 0))
    failures = [Unavailable("destination refused") for _ in range(len(ids) ** 2)]
    migrator = make_migrator(view, clock, FakeSources(*failures), settings=MigrationSettings(is_enabled=False),
                             failure_backoff_s=2.0)
    for src in ids:
        for dst in ids:
            if src != dst:
                with pytest.raises(Unavailable):
                    await migrator.migrate(migrator.admin_order(src, dst, ""))
    assert len(migrator._pacing._failed_at) == len(ids) * (len(ids) - 1)
    clock.advance(2.0)
    for i in ids:
        report(view, i, 0)
    migrator.tick()
    assert len(migrator._pacing._failed_at) == 0, f"{len(migrator._pacing._failed_at)} pairs kept past their 2 s backoff"


# 12. Scaler._stoppable_since kept the instances of a target a new term no longer follows (another leader
#     finished that retirement meanwhile): one entry per such retirement, for ever.
async def test_a_new_term_forgets_when_it_saw_instances_of_a_target_it_no_longer_follows():
    clock = FakeClock()
    view, store = retiring_i2(clock)
    leadership = leader()
    scaler = Scaler(view, leadership, store, FAILOVER_BAND, interval_s=1, cooldown_s=60, clock=clock)
    await scaler.tick()  # i-2 empty and heard: stoppable
    assert list(scaler._stoppable_since) == ["i-2"]
    leadership.set_elected(False)
    await scaler.tick()
    store.target = ScalingTarget(2, reason="another leader retired i-2", manager_id="m-2", updated_at=time.time())
    leadership.set_elected(True)
    await scaler.tick()
    assert scaler._stoppable_since == {}
