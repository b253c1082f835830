"""The migrator without sockets: plans, limits, settling, cooldown, failures, admin orders, history."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from services.manager import convert, metrics
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceId, InstanceRecord, Role
from services.manager.leadership import Leadership
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationSelection, MigrationSettings, MigrationTrigger)
from services.manager.migration_settle import HeldRequest, RequestOrigin
from services.manager.migrator import OWED_SETTLE_S, OWED_WORK_INTERVAL_S, Migrator, MigratorLimits
from tests.unit.loop_checks import assert_cancels, until
from tests.unit.manager.factories import FakeClock, make_load, make_record

pytestmark = pytest.mark.timeout(10)

ON = MigrationSettings(is_enabled=True, threshold=1.0)

MIGRATED_IN_FROM_A = HeldRequest(RequestOrigin.MIGRATED_IN, "a")  # what a destination says of a request a moved there


class FakeSources:
    """MigrateOutClient: answers each call with the next scripted figures or error; `gate` holds calls open."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.orders = []
        self.gate: asyncio.Event | None = None
        self.held: dict[tuple[str, str], HeldRequest] = {}  # (address, request id): what held_request answers

    async def held_request(self, address, request_id, timeout_s):
        return self.held.get((address, request_id))

    async def migrate_out(self, order, timeout_s, on_picked):
        self.orders.append(order)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0) if self.answers else MigrationFigures(f"r-{len(self.orders)}", num_blocks=4)
        if isinstance(answer, Exception):
            raise answer
        return answer


class RpcCause(Exception):
    """Stands in for grpc.aio.AioRpcError as an error's __cause__."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def code(self):
        return self


def cluster(clock: FakeClock, **loads):
    """A view with one member per keyword (id=running count), each with 10 blocks a request, just reported."""
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, num_running in loads.items():
        view.put_member(make_record(instance_id))
        report(view, instance_id, num_running)
    return view


def report(view, instance_id: str, num_running: int, **load) -> None:
    view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=1000 - 10 * num_running,
                                                         num_running=num_running, **load))


def make_migrator(view, clock, sources, settings=ON, leadership=None, record_sink=None, journaled=None,
                  **limits) -> Migrator:
    if leadership is None:
        leadership = Leadership("m-1", "127.0.0.1:1")
        leadership.set_elected(True)
    return Migrator(view, leadership, sources, MigratorLimits(**limits), settings, clock=clock, wall_clock=lambda: 5.0,
                    record_sink=record_sink, journaled=journaled)


def routes(orders) -> list[tuple[str, str, MigrationTrigger]]:
    return [(o.src_instance_id, o.dst_instance_id, o.trigger) for o in orders]


async def settle(migrator) -> None:
    while migrator._tasks:
        await asyncio.sleep(0)


async def test_a_tick_pairs_loaded_with_free_and_the_migration_is_recorded():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=4)
    sources = FakeSources(MigrationFigures("r-1", num_blocks=6, num_bytes=600, num_stages=2, backend="grpc",
                                           duration_ms=30.0, downtime_ms=4.0))
    migrator = make_migrator(view, clock, sources, settings=MigrationSettings(
        is_enabled=True, threshold=1.0, selection=MigrationSelection.LAST_COME_FIRST), backend="shm")
    before = metrics.MIGRATED_BYTES._value.get()
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD)]
    await settle(migrator)
    (order,) = sources.orders
    assert (order.selection, order.backend, order.request_id) == (MigrationSelection.LAST_COME_FIRST, "shm", "")
    (record,) = migrator.history()
    assert record.outcome is MigrationOutcome.COMMITTED and record.figures.num_bytes == 600
    assert record.started_at == 5.0
    assert metrics.MIGRATED_BYTES._value.get() - before == 600


async def test_migration_off_moves_nothing_but_drains_still_move():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=3)
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False))
    assert migrator.plan() == []
    view.mark_drained(InstanceId("c"))
    assert routes(migrator.plan()) == [("c", "b", MigrationTrigger.DRAIN)]


async def test_drains_go_first_and_take_their_destination():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=6, d=1)
    view.mark_drained(InstanceId("c"))
    migrator = make_migrator(view, clock, FakeSources())
    assert routes(migrator.plan()) == [("c", "b", MigrationTrigger.DRAIN), ("a", "d", MigrationTrigger.LOAD)]


async def test_a_draining_instance_gone_silent_is_no_drain_source():
    # Its state shows DRAINING, not UNHEALTHY; a MigrateOut to a stalled engine would hold its
    # destination's slot until the call's deadline (found by review).
    clock = FakeClock()
    view = cluster(clock, a=0, c=6)
    view.mark_drained(InstanceId("c"))
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False))
    clock.advance(5.0)  # past the report timeout; only a reports again
    report(view, "a", 0)
    assert migrator.plan() == []
    report(view, "c", 6)
    assert routes(migrator.plan()) == [("c", "a", MigrationTrigger.DRAIN)]


async def test_an_instance_at_its_limit_sits_out_then_waits_for_a_fresh_report():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=8, d=0)
    sources = FakeSources()
    sources.gate = asyncio.Event()
    migrator = make_migrator(view, clock, sources)
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD), ("c", "d", MigrationTrigger.LOAD)]
    await asyncio.sleep(0)
    assert migrator.plan() == []  # all four hold a migration slot (max_per_instance 1)
    sources.gate.set()
    await settle(migrator)
    clock.advance(0.1)
    assert migrator.plan() == []  # the last reports predate the migrations' end
    report(view, "a", 7)
    report(view, "b", 1)
    assert routes(migrator.plan()) == [("a", "b", MigrationTrigger.LOAD)]


async def test_a_request_that_just_moved_is_excluded_until_its_cooldown_ends():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0)
    migrator = make_migrator(view, clock, FakeSources(MigrationFigures("r-moved")), cooldown_s=10.0)
    migrator.tick()
    await settle(migrator)
    clock.advance(1.0)
    report(view, "a", 7)
    report(view, "b", 1)
    (order,) = migrator.plan()
    assert order.exclude_request_ids == {"r-moved"}
    clock.advance(10.0)
    report(view, "a", 7)
    report(view, "b", 1)
    assert migrator.plan()[0].exclude_request_ids == frozenset()


async def test_failures_are_recorded_by_grpc_status_and_the_loop_goes_on():
    """A destination's refusal for want of room (RESOURCE_EXHAUSTED: it filled since the report it was picked on) is
    no fault: recorded and counted `refused`, not `failed`, and not in the failures by status. Before, under KV
    pressure dozens of such `failed` migrations came (the README's PromQL for faults left their status out)."""
    clock = FakeClock()
    view = cluster(clock, a=8, b=0)
    unimplemented = Unavailable("Method not found!")
    unimplemented.__cause__ = RpcCause("UNIMPLEMENTED")
    sources = FakeSources(ResourceExhausted("destination has 2 free blocks, needs 6"), unimplemented)
    migrator = make_migrator(view, clock, sources, failure_backoff_s=2.0)
    before = _outcome_counts()
    for _ in range(2):
        migrator.tick()
        await settle(migrator)
        clock.advance(0.5)
        report(view, "a", 8)
        report(view, "b", 0)
        assert migrator.plan() == []  # the pair that failed backs off
        clock.advance(1.5)
    first, second = migrator.history()
    assert (first.outcome, first.reason, first.message) == (
        MigrationOutcome.REFUSED, "RESOURCE_EXHAUSTED", "destination has 2 free blocks, needs 6")
    assert (second.outcome, second.reason) == (MigrationOutcome.FAILED, "UNIMPLEMENTED")
    assert {k: n - before[k] for k, n in _outcome_counts().items()} == {
        "refused": 1, "failed": 1, "failures RESOURCE_EXHAUSTED": 0, "failures UNIMPLEMENTED": 1}
    assert migrator._pacing._in_flight == {}


def _outcome_counts() -> dict[str, float]:
    """Load migrations refused and failed, and failures by status (ferry_manager_migration_failures_total)."""
    counts = {o: metrics.MIGRATIONS.labels(o, "load")._value.get() for o in ("refused", "failed")}
    return counts | {f"failures {r}": metrics.MIGRATION_FAILURES.labels(r)._value.get()
                     for r in ("RESOURCE_EXHAUSTED", "UNIMPLEMENTED")}


async def test_a_failure_is_recorded_under_the_request_the_source_picked():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0)
    migrator = make_migrator(view, clock, FakeSources(Aborted("the destination vanished", request_id="r-7")))
    migrator.tick()
    await settle(migrator)
    (record,) = migrator.history(request_id="r-7")
    assert record.outcome is MigrationOutcome.FAILED and record.order.request_id == ""


async def test_an_admin_migrate_whose_caller_gives_up_runs_on_and_is_recorded():
    """ferryctl's deadline cancels the Migrate call; the source goes on and commits, so the record must too."""
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    sources = FakeSources(MigrationFigures("r-9", num_blocks=3))
    sources.gate = asyncio.Event()
    migrator = make_migrator(view, clock, sources)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(migrator.migrate_to_the_end(migrator.admin_order("a", "b", "r-9")), 0.05)
    sources.gate.set()
    await settle(migrator)
    (record,) = migrator.history(request_id="r-9")
    assert record.outcome is MigrationOutcome.COMMITTED and record.figures.num_blocks == 3


async def test_admin_migrate_raises_the_sources_error_after_recording_it():
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    migrator = make_migrator(view, clock, FakeSources(Aborted("the destination b did not answer")))
    order = migrator.admin_order("a", "b", "r-9")
    with pytest.raises(Aborted):
        await migrator.migrate(order)
    (record,) = migrator.history(request_id="r-9")
    assert record.order.trigger is MigrationTrigger.ADMIN and record.reason == "ABORTED"


async def test_admin_orders_check_instances_and_pick_the_freest_destination():
    clock = FakeClock()
    view = cluster(clock, a=5, b=2, c=1, d=1)
    migrator = make_migrator(view, clock, FakeSources())
    order = migrator.admin_order("a", "", "r-1")
    assert (order.dst_instance_id, order.request_id) == ("c", "r-1")  # c and d tie: the smaller id
    with pytest.raises(NotFound, match="source instance 'zz' is not registered"):
        migrator.admin_order("zz", "", "")
    with pytest.raises(NotFound, match="destination instance 'zz'"):
        migrator.admin_order("a", "zz", "")
    with pytest.raises(FailedPrecondition, match="source and destination are both a"):
        migrator.admin_order("a", "a", "")
    view.mark_drained(InstanceId("b"))
    with pytest.raises(FailedPrecondition, match="destination b is draining"):
        migrator.admin_order("a", "b", "")
    view.put_member(make_record("p", role=Role.PREFILL))
    report(view, "p", 0)
    with pytest.raises(FailedPrecondition, match="destination p is a prefill instance"):
        migrator.admin_order("a", "p", "")
    assert migrator.admin_order("a", "", "").dst_instance_id != "p"  # never chosen either
    for other in ("c", "d"):
        view.mark_drained(InstanceId(other))
    with pytest.raises(FailedPrecondition, match=r"take a request from a; start one, undrain one \(python -m "):
        migrator.admin_order("a", "", "")


async def test_admin_migrate_takes_no_busy_destination_unless_named_and_then_says_why_it_was_refused():
    """A destination reporting no free migration slot (one pool for migrations in and out) refuses the move: an
    admin Migrate naming no destination takes another; one naming it is still tried, and its refusal says so."""
    clock = FakeClock()
    view = cluster(clock, a=5, b=1, c=2)
    report(view, "b", 1, num_free_migration_out_slots=0)  # the freest, but its slots are busy
    refusal = ResourceExhausted("this instance already runs 1 migration(s), the most --max-concurrent-migrations "
                                "1 allows; retry later or pick another instance")
    sources = FakeSources(refusal)
    migrator = make_migrator(view, clock, sources)
    assert migrator.admin_order("a", "", "r-1").dst_instance_id == "c"
    with pytest.raises(ResourceExhausted, match=r"destination instance b refused the migration: this instance "
                       r"already runs .* \(it reported no free migration slot: .*--max-concurrent-migrations"):
        await migrator.migrate_to_the_end(migrator.admin_order("a", "b", "r-1"))
    assert routes(sources.orders) == [("a", "b", MigrationTrigger.ADMIN)]  # tried all the same
    report(view, "c", 2, num_free_migration_out_slots=0)
    with pytest.raises(FailedPrecondition, match="no other serving instance has a free KV block, batch slot and "
                       "migration slot"):
        migrator.admin_order("a", "", "r-1")


async def test_admin_orders_without_a_destination_take_turns_among_equally_free_instances():
    """One request moved on and on with no dst: it must visit every idle instance, not bounce between two."""
    clock = FakeClock()
    view = cluster(clock, a=1, b=0, c=0)
    migrator = make_migrator(view, clock, FakeSources())
    src, visited = "a", []
    for _ in range(4):
        order = migrator.admin_order(src, "", "r-1")
        await migrator.migrate(order)
        clock.advance(1.0)
        report(view, src, 0)
        report(view, order.dst_instance_id, 1)
        src = order.dst_instance_id
        visited.append(src)
    assert set(visited[:3]) == {"a", "b", "c"}  # before: b, a, b, a


async def test_the_loop_ticks_fast_while_drains_move_requests_and_not_when_they_cannot():
    clock = FakeClock()
    view = cluster(clock, a=3, b=0)
    sources = FakeSources()
    sources.gate = asyncio.Event()  # the drain's migration runs until the gate opens
    migrator = make_migrator(view, clock, sources, settings=MigrationSettings(), interval_s=0.5)
    await migrator._tick_if_leading()
    assert migrator._next_interval_s() == 0.5  # balancing is off: the usual pace
    view.mark_drained(InstanceId("a"))
    await migrator._tick_if_leading()
    await asyncio.sleep(0)  # the migration's task calls the source
    assert routes(sources.orders) == [("a", "b", MigrationTrigger.DRAIN)]
    assert migrator._next_interval_s() == OWED_WORK_INTERVAL_S  # the next goes once this one settled
    sources.gate.set()
    await settle(migrator)
    await migrator._tick_if_leading()  # a settles with a fresh report
    assert migrator._next_interval_s() == OWED_WORK_INTERVAL_S
    clock.advance(OWED_SETTLE_S)
    view.mark_drained(InstanceId("b"))  # nowhere left to go: a and b both draining
    await migrator._tick_if_leading()
    assert len(sources.orders) == 1 and migrator._next_interval_s() == 0.5


async def test_a_reported_pd_failure_does_not_hold_back_the_loops_own_try():
    clock = FakeClock()
    view = cluster(clock)
    view.put_member(make_record("p", role=Role.PREFILL))
    view.apply_report(InstanceId("p"), dataclasses.replace(make_load(num_running=1, num_free_blocks=990),
                                                           num_prefilled=1))
    view.put_member(make_record("d", role=Role.DECODE))
    report(view, "d", 0)
    migrator = make_migrator(view, clock, FakeSources())
    order = MigrationOrder(InstanceId("p"), "", InstanceId("d"), "", MigrationTrigger.PD, request_id="r-1")
    migrator.keep_reported(MigrationRecord(order, MigrationOutcome.FAILED, MigrationFigures("r-1"), 5.0,
                                           reason="RESOURCE_EXHAUSTED"))
    assert routes(migrator.plan()) == [("p", "d", MigrationTrigger.PD)]
    assert migrator.history(request_id="r-1")[0].reason == "RESOURCE_EXHAUSTED"


async def test_history_is_bounded_and_filtered():
    clock = FakeClock()
    view = cluster(clock, a=2, b=0, c=0)
    migrator = make_migrator(view, clock, FakeSources(), history_size=3)
    for dst in ("b", "c", "b", "c"):
        await migrator.migrate(migrator.admin_order("a", dst, ""))
    assert [r.order.dst_instance_id for r in migrator.history()] == ["c", "b", "c"]
    assert [r.order.dst_instance_id for r in migrator.history(instance_id="b")] == ["b"]
    assert [r.figures.request_id for r in migrator.history(request_id="r-4")] == ["r-4"]


async def test_a_drained_instance_is_reported_empty():
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    view.mark_drained(InstanceId("a"))
    assert not view.instance(InstanceId("a")).is_drained
    report(view, "a", 0)
    assert view.instance(InstanceId("a")).is_drained
    migrator = make_migrator(view, clock, FakeSources())
    assert migrator.tick() == []  # nothing left to move


async def test_the_loop_acts_only_while_leading():
    clock = FakeClock()
    view = cluster(clock, a=8, b=0)
    sources = FakeSources()
    migrator = make_migrator(view, clock, sources, interval_s=0.01)
    migrator._leadership.set_elected(False)
    loop = asyncio.create_task(migrator.migration_loop())
    await asyncio.sleep(0.05)
    assert sources.orders == []
    migrator._leadership.set_elected(True)
    while not sources.orders:
        await asyncio.sleep(0.01)
    loop.cancel()
    await migrator.close()


class FlakyClusterView(ClusterView):
    """A view whose first listing of the instances raises (a race while members change)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_listings = 0

    def instances(self):
        self.num_listings += 1
        if self.num_listings == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return super().instances()


async def test_a_tick_that_raises_does_not_end_the_migration_loop():
    clock = FakeClock()
    view = FlakyClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, num_running in (("a", 8), ("b", 0)):
        view.put_member(make_record(instance_id))
        report(view, instance_id, num_running)
    sources = FakeSources()
    migrator = make_migrator(view, clock, sources, interval_s=0.01)
    loop = asyncio.create_task(migrator.migration_loop())
    await until(lambda: bool(sources.orders), loop)
    assert routes(sources.orders) == [("a", "b", MigrationTrigger.LOAD)]
    await assert_cancels(loop)
    await settle(migrator)


@pytest.mark.parametrize("status", ["UNAVAILABLE", "DEADLINE_EXCEEDED"])
async def test_an_unanswered_migrate_whose_request_is_on_the_destination_is_recorded_committed(status):
    """The source froze (or died) after the commit, before its answer: the destination holds the request."""
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    unanswered = Unavailable("the source did not answer in time")
    unanswered.__cause__ = RpcCause(status)
    sources = FakeSources(unanswered, unanswered)
    migrator = make_migrator(view, clock, sources)
    order = migrator.admin_order("a", "b", "r-5")
    sources.held[order.dst_address, "r-5"] = MIGRATED_IN_FROM_A
    record = await migrator.migrate(order)
    assert record.outcome is MigrationOutcome.COMMITTED and "gave no answer" in record.message
    sources.held.clear()  # not there (yet): asked again later (test_migration_settle.py)
    with pytest.raises(Unavailable):
        await migrator.migrate(migrator.admin_order("a", "b", "r-5"))
    assert [r.outcome for r in migrator.history(request_id="r-5")] == [MigrationOutcome.COMMITTED,
                                                                       MigrationOutcome.UNKNOWN]
    await migrator.close()


@pytest.mark.parametrize("held", [HeldRequest(RequestOrigin.RESUMED), HeldRequest(RequestOrigin.MIGRATED_IN, "c"),
                                  HeldRequest(RequestOrigin.UNKNOWN)])
async def test_an_unanswered_migrate_whose_request_came_to_the_destination_another_way_is_not_committed(held):
    """The source froze past the deadline and the frontend resumed the request on the destination (or it came
    there from elsewhere, or an older destination cannot say): that is no commit of this migration. Before, a
    destination holding the request at all made Migrate answer ok with 0 blocks, recorded committed."""
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    unanswered = Unavailable("the source did not answer in time")
    unanswered.__cause__ = RpcCause("DEADLINE_EXCEEDED")
    sources = FakeSources(unanswered)
    migrator = make_migrator(view, clock, sources)
    order = migrator.admin_order("a", "b", "r-5")
    sources.held[order.dst_address, "r-5"] = held
    with pytest.raises(Unavailable):
        await migrator.migrate(order)
    assert [r.outcome for r in migrator.history(request_id="r-5")] == [MigrationOutcome.UNKNOWN]
    await migrator.close()


async def test_a_refused_migrate_is_failed_whatever_the_destination_holds():
    clock = FakeClock()
    view = cluster(clock, a=2, b=0)
    sources = FakeSources(Aborted("the request finished mid-migration"))
    migrator = make_migrator(view, clock, sources)
    order = migrator.admin_order("a", "b", "r-6")
    sources.held[order.dst_address, "r-6"] = MIGRATED_IN_FROM_A
    with pytest.raises(Aborted):
        await migrator.migrate(order)


class MovingSources(FakeSources):
    """Instances with `running` requests of 10 blocks each; a MigrateOut commits when `finish_older` says."""

    def __init__(self, running: dict[str, int]) -> None:
        super().__init__()
        self.running = running
        self.pending: list[tuple[int, asyncio.Event]] = []
        self.tick = 0

    async def migrate_out(self, order, timeout_s, on_picked):
        self.orders.append(order)
        done = asyncio.Event()
        self.pending.append((self.tick, done))
        await done.wait()
        self.running[order.src_instance_id] -= 1
        self.running[order.dst_instance_id] += 1
        return MigrationFigures(f"r-{len(self.orders)}", num_blocks=10)

    def finish_older(self, ticks: int) -> None:
        for entry in [e for e in self.pending if self.tick - e[0] >= ticks]:
            entry[1].set()
            self.pending.remove(entry)


async def test_load_moves_with_more_slots_per_instance_never_swap_a_pair():
    # With --migration-max-per-instance 2 a pair whose move was in flight was paired again from loads
    # that did not show that move yet: it overshot, and the loop moved requests back (found by review).
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    running = {"a": 40, "b": 20}
    for instance_id in running:
        view.put_member(make_record(instance_id))
    sources = MovingSources(running)
    migrator = make_migrator(view, clock, sources, max_per_instance=2)
    for _ in range(60):  # 0.5 s ticks; each MigrateOut takes 2 ticks, every instance reports between ticks
        for instance_id, num_running in running.items():
            report(view, instance_id, num_running)
        migrator.tick()
        for _ in range(3):
            await asyncio.sleep(0)
        sources.tick += 1
        sources.finish_older(2)
        for _ in range(5):
            await asyncio.sleep(0)
        clock.advance(0.5)
    routes = [(o.src_instance_id, o.dst_instance_id) for o in sources.orders]
    assert ("b", "a") not in routes and abs(running["a"] - running["b"]) <= 2, (routes, running)


@pytest.mark.parametrize("room", [dict(num_free_migration_out_slots=1), dict(num_free_slots=1)],
                         ids=["migration-slot", "batch-slot"])
async def test_a_destination_a_migration_just_started_into_is_not_picked_again_on_a_report_from_before(room):
    """With --migration-max-per-instance 2, a drain's second move went to the destination with room for one
    request that its first move had just taken: planned on a report that did not show the first one yet, it was
    refused (RESOURCE_EXHAUSTED). The first holds a batch slot and a migration slot there until a report shows it
    or it ends, so the second goes to the next-freest destination."""
    clock = FakeClock()
    view = cluster(clock, b=0, c=2, d=1)
    view.mark_drained(InstanceId("c"))
    report(view, "b", 0, **room)
    sources = FakeSources()
    sources.gate = asyncio.Event()
    migrator = make_migrator(view, clock, sources, max_per_instance=2)
    assert routes(migrator.tick()) == [("c", "b", MigrationTrigger.DRAIN)]  # one pair per destination a tick
    await asyncio.sleep(0)
    clock.advance(0.1)
    for instance_id, num_running in (("b", 0), ("c", 2), ("d", 1)):  # sent before b's PrepareMigrateIn
        report(view, instance_id, num_running, **room if instance_id == "b" else {})
    assert routes(migrator.plan()) == [("c", "d", MigrationTrigger.DRAIN)]
    report(view, "b", 0, **{k: 0 for k in room}, num_incoming_migrations=1)  # shows it: full
    assert routes(migrator.plan()) == [("c", "d", MigrationTrigger.DRAIN)]
    sources.gate.set()
    await settle(migrator)
    clock.advance(0.1)
    for instance_id, num_running in (("b", 1), ("c", 1), ("d", 3)):
        report(view, instance_id, num_running, **room if instance_id == "b" else {})
    assert routes(migrator.plan()) == [("c", "b", MigrationTrigger.DRAIN)]  # ended: b has room for one more again


async def test_what_is_kept_per_instance_goes_when_it_leaves():
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id in ("stay", "gone"):
        view.put_member(make_record(instance_id))
    report(view, "stay", 0)
    report(view, "gone", 30)
    sources = FakeSources(MigrationFigures("r-1", num_blocks=10), Unavailable("gone away"))
    migrator = make_migrator(view, clock, sources, failure_backoff_s=1e9)
    view.mark_drained(InstanceId("gone"))
    for _ in range(2):  # one migration ends, one fails: both leave per-instance state behind
        migrator.tick()
        for _ in range(5):
            await asyncio.sleep(0)
        clock.advance(1.0)
        report(view, "gone", 30)
        report(view, "stay", 0)
    assert migrator._pacing._ended_at and migrator._pacing._received_at and migrator._pacing._failed_at
    view.remove_member(InstanceId("gone"))
    migrator.tick()
    assert "gone" not in {*migrator._pacing._ended_at, *migrator._pacing._received_at, *(i for p in migrator._pacing._failed_at for i in p)}


async def test_a_lone_request_just_dispatched_is_not_counted_twice_and_stays():
    """A report within IN_TRANSIT_S of a dispatch counts the request, and its reservation is still
    kept: as a source the instance looked like it held two, and its one request moved to the idle
    instance at once (every lone request on a two-instance cluster, in a black-box run)."""
    clock = FakeClock()
    view = cluster(clock, a=0, b=0)
    view.reserve(InstanceId("a"), num_blocks=10)
    clock.advance(0.1)
    report(view, "a", 1)  # it arrived; its reservation is kept for IN_TRANSIT_S
    assert view.instance(InstanceId("a")).load.num_running == 2
    migrator = make_migrator(view, clock, FakeSources())
    assert migrator.tick() == []
    report(view, "a", 3)  # three it holds: one moves
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD)]
    await settle(migrator)


async def test_a_drain_onto_a_prefill_instance_says_it_chose_it_on_purpose():
    """A PREFILL instance refuses migrations in (FAILED_PRECONDITION) unless the order says the manager chose it on
    purpose: a drain of the last decode instance, whose requests have nowhere else to go."""
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, role in (("d", Role.DECODE), ("p", Role.PREFILL), ("b", Role.BOTH)):
        view.put_member(make_record(instance_id, role=role))
    report(view, "d", 3)
    report(view, "p", 0)
    report(view, "b", 5)
    view.mark_drained(InstanceId("d"))
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False))
    [order] = migrator.plan()
    assert (order.dst_instance_id, order.can_decode_on_prefill) == ("b", False)  # a decoding one can take them
    view.mark_drained(InstanceId("b"))
    [order] = migrator.plan()  # (b waits for a destination of its own)
    assert (order.dst_instance_id, order.can_decode_on_prefill) == ("p", True)  # the last resort
    assert convert.migrate_out_request_to_proto(order).can_decode_on_prefill


async def test_a_drain_waits_for_a_decode_instance_that_sits_a_tick_out_rather_than_use_a_prefill_one():
    """After a drain's move to the only other decode instance, the drained one reported first: the decode instance,
    waiting for its own report, was no peer, and the next request went to the PREFILL instance (the last resort,
    for when no decode instance serves), which hands it on again."""
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, role in (("d1", Role.DECODE), ("d2", Role.DECODE), ("p", Role.PREFILL)):
        view.put_member(make_record(instance_id, role=role))
        report(view, instance_id, 3 if instance_id == "d1" else 0)
    view.mark_drained(InstanceId("d1"))
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False))
    assert routes(migrator.tick()) == [("d1", "d2", MigrationTrigger.DRAIN)]
    await settle(migrator)
    clock.advance(0.1)
    report(view, "d1", 2)  # d2's report is not in yet
    assert migrator.tick() == []
    report(view, "d2", 1)
    assert routes(migrator.tick()) == [("d1", "d2", MigrationTrigger.DRAIN)]
    await settle(migrator)


async def test_a_destination_that_refuses_by_its_role_leaves_the_next_tick_to_another():
    """Its record may still show it decode (the SetRole's record on its way): the pair backs off."""
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=2)
    sources = FakeSources(FailedPrecondition("instance b has role prefill and takes no migrations in"))
    migrator = make_migrator(view, clock, sources, failure_backoff_s=2.0)
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD)]
    await settle(migrator)
    clock.advance(0.5)
    for instance_id, num_running in (("a", 8), ("b", 0), ("c", 2)):
        report(view, instance_id, num_running)
    assert routes(migrator.plan()) == [("a", "c", MigrationTrigger.LOAD)]


async def test_orders_name_the_destinations_max_model_len_so_the_source_picks_a_request_it_takes():
    """A destination serving shorter sequences refuses the source's requests that may grow past them; when
    it is the only one, the source must pick among the others, or the drain offers it the same refused one
    after each back-off. 0 where its record has none (an older instance): the source picks as before."""
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, max_model_len in (("a", 1024), ("short", 256)):
        view.put_member(dataclasses.replace(make_record(instance_id), max_model_len=max_model_len))
        report(view, instance_id, 3 if instance_id == "a" else 0)
    view.mark_drained(InstanceId("a"))
    migrator = make_migrator(view, clock, FakeSources(), settings=MigrationSettings(is_enabled=False))
    [order] = migrator.plan()
    assert (order.dst_instance_id, order.dst_max_model_len) == ("short", 256)
    assert convert.migrate_out_request_to_proto(order).dst_max_model_len == 256
    assert migrator.admin_order("a", "short", "").dst_max_model_len == 256
    view.put_member(make_record("short"))  # its record without max_model_len
    assert migrator.admin_order("a", "short", "").dst_max_model_len == 0


async def test_an_instance_of_another_model_is_never_paired():
    """A black-box run on three "hosts" (2026-12-07): a tiny model's instance (3 layers, 512 tokens) beside
    SmolLM2's (30 layers) was the freest, so it was the first destination tried, and its copy failed "kv geometry
    mismatch" before the next-freest was tried. A record without the fields (an older instance) pairs as before."""
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=4, d=6)
    smol = {"kv_layout": (30, 3, 64, 16, "float32"), "vocab_size": 49152}
    for instance_id, fields in {"a": smol, "b": {"kv_layout": (3, 2, 16, 16, "float32"), "vocab_size": 512},
                                "c": smol, "d": {**smol, "vocab_size": 32000}}.items():
        view.put_member(dataclasses.replace(make_record(instance_id), **fields))
    migrator = make_migrator(view, clock, FakeSources())
    assert routes(migrator.plan()) == [("a", "c", MigrationTrigger.LOAD)]
    view.mark_drained(InstanceId("a"))
    assert routes(migrator.plan()) == [("a", "c", MigrationTrigger.DRAIN)]
    view.put_member(dataclasses.replace(make_record("b"), vocab_size=49152))  # an older record: no kv layout
    assert routes(migrator.plan())[0] == ("a", "b", MigrationTrigger.DRAIN)


async def test_an_admin_migrate_never_goes_to_an_instance_of_another_model():
    """The same run: `ferryctl migrate --request ID` (no --dst) took the freest instance, the tiny model's, and
    failed "kv geometry mismatch" every time, with two SmolLM2 instances free."""
    clock = FakeClock()
    view = cluster(clock, a=5, b=0, c=1)
    smol = {"kv_layout": (30, 3, 64, 16, "float32"), "vocab_size": 49152}
    for instance_id, fields in {"a": smol, "b": {"kv_layout": (3, 2, 16, 16, "float32"), "vocab_size": 512},
                                "c": smol}.items():
        view.put_member(dataclasses.replace(make_record(instance_id), **fields))
    migrator = make_migrator(view, clock, FakeSources())
    assert migrator.admin_order("a", "", "r-1").dst_instance_id == "c"
    with pytest.raises(FailedPrecondition, match="destination b serves another model than a .*one model"):
        migrator.admin_order("a", "b", "r-1")


async def test_two_fine_tunes_of_one_base_are_never_paired():
    """Two fine-tunes of one base share KV layout and vocabulary: only the weights' fingerprints tell them apart.
    Moved from one to the other, a request went on with the other's weights (wrong answers, silently). Neither
    balancing, a drain nor an admin Migrate pairs them; a record without a fingerprint (an older instance) pairs
    as before."""
    clock = FakeClock()
    view = cluster(clock, a=8, b=0, c=4)
    smol = {"kv_layout": (30, 3, 64, 16, "float32"), "vocab_size": 49152}
    for instance_id, fingerprint in {"a": "aaaa000000000001", "b": "bbbb000000000002", "c": "aaaa000000000001"}.items():
        view.put_member(dataclasses.replace(make_record(instance_id), **smol, model_fingerprint=fingerprint))
    migrator = make_migrator(view, clock, FakeSources())
    assert routes(migrator.plan()) == [("a", "c", MigrationTrigger.LOAD)]
    assert migrator.admin_order("a", "", "r-1").dst_instance_id == "c"
    with pytest.raises(FailedPrecondition, match="destination b serves another model than a .*fingerprint"):
        migrator.admin_order("a", "b", "r-1")
    view.mark_drained(InstanceId("a"))
    assert routes(migrator.plan()) == [("a", "c", MigrationTrigger.DRAIN)]
    view.put_member(dataclasses.replace(make_record("b"), **smol))  # an older record: no fingerprint
    assert routes(migrator.plan())[0] == ("a", "b", MigrationTrigger.DRAIN)


def test_the_record_gives_the_kv_layout_and_vocabulary():
    record = InstanceRecord.from_dict("x", {"address": "a:1", "vocab_size": 512, "kv": {
        "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "block_size": 4, "num_blocks": 64, "dtype": "float32"}})
    assert (record.kv_layout, record.vocab_size) == ((3, 2, 16, 4, "float32"), 512)
    assert (InstanceRecord.from_dict("x", {"address": "a:1"}).kv_layout, record.holds_same_model(record)) == ((), True)
    tuned = InstanceRecord.from_dict("y", {"address": "a:2", "model_fingerprint": "89c9c3224d2ef4bb"})
    assert (tuned.model_fingerprint, InstanceRecord.from_dict("x", {"address": "a:1"}).model_fingerprint) == (
        "89c9c3224d2ef4bb", "")
    assert record.holds_same_model(tuned) and not tuned.holds_same_model(
        dataclasses.replace(tuned, model_fingerprint="0123456789abcdef"))
