"""Migrations whose source gave no answer: kept as unknown, then found out from the instances (no sockets).

Before, a MigrateOut that answered DEADLINE_EXCEEDED (or UNAVAILABLE) was recorded failed, and counted as a
failure, unless the destination held the request at that very moment; but the source's migration runs on after
the caller's deadline and may commit later, and a loop migration's request was not even known to ask about."""

from __future__ import annotations

import asyncio

import pytest

from services.manager import metrics
from services.manager.leadership import Leadership
from services.manager.domain import InstanceId
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationTrigger)
from services.manager.migration_settle import HeldRequest, RequestOrigin, Settler, SourceUnanswered, SourceUnreached
from tests.unit.loop_checks import until
from tests.unit.manager.factories import FakeClock
from tests.unit.manager.test_migrator import (MIGRATED_IN_FROM_A, FakeSources, RpcCause, cluster, make_migrator,
                                              routes, settle)

pytestmark = pytest.mark.timeout(10)

LOOKS_AT_S = (0.01, 0.02, 0.05)


def unanswered(status: str, request_id: str, migration_id: str = "") -> SourceUnanswered:
    """What the manager's client raises: the source named its pick in the call's initial metadata."""
    error = SourceUnanswered("MigrateOut on source instance a: Deadline Exceeded", request_id, migration_id)
    error.__cause__ = RpcCause(status)
    return error


def migrated_in_from_a(migration_id: str) -> HeldRequest:
    return HeldRequest(RequestOrigin.MIGRATED_IN, "a", migration_id)


def counted(outcome: str, trigger: str = "load") -> float:
    return metrics.MIGRATIONS.labels(outcome, trigger)._value.get()


def failures(reason: str) -> float:
    return metrics.MIGRATION_FAILURES.labels(reason)._value.get()


async def a_loop_migration_unanswered(status: str, request_id: str, migration_id: str = "", **kwargs):
    clock = FakeClock()
    view = cluster(clock, a=3, b=0)
    sources = FakeSources(unanswered(status, request_id, migration_id))
    migrator = make_migrator(view, clock, sources, **{"settle_looks_at_s": LOOKS_AT_S, **kwargs})
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD)]
    await settle(migrator)
    (record,) = migrator.history()
    assert record.outcome is MigrationOutcome.UNKNOWN, f"recorded {record.outcome.value} before anyone could tell"
    assert record.figures.request_id == request_id and record.reason == status
    return migrator, sources, record


async def settled_once_the_destination_holds(held: HeldRequest, outcome: MigrationOutcome, request_id: str,
                                             migration_id: str = "") -> MigrationRecord:
    """An unanswered loop migration (DEADLINE_EXCEEDED) whose destination then holds its request as `held`:
    its record once settled `outcome` (the migrator closed)."""
    migrator, sources, record = await a_loop_migration_unanswered("DEADLINE_EXCEEDED", request_id, migration_id)
    assert record.figures.migration_id == migration_id
    sources.held[record.order.dst_address, request_id] = held
    await until(lambda: migrator.history()[0].outcome is outcome, asyncio.current_task())
    (settled,) = migrator.history()
    await migrator.close()
    return settled


async def test_a_loop_migration_past_its_deadline_that_commits_later_is_recorded_committed():
    committed, failed = counted("committed"), failures("DEADLINE_EXCEEDED")
    migrator, sources, record = await a_loop_migration_unanswered("DEADLINE_EXCEEDED", "r-7")
    sources.held[record.order.dst_address, "r-7"] = MIGRATED_IN_FROM_A  # the source's migration committed after the deadline
    await until(lambda: migrator.history()[0].is_committed, asyncio.current_task())
    assert "committed after all" in migrator.history()[0].message
    assert counted("committed") == committed + 1 and failures("DEADLINE_EXCEEDED") == failed
    await migrator.close()


async def test_an_unanswered_migration_whose_request_stayed_on_the_source_is_failed():
    failed = failures("UNAVAILABLE")
    migrator, sources, record = await a_loop_migration_unanswered("UNAVAILABLE", "r-8")
    sources.held[record.order.src_address, "r-8"] = HeldRequest(RequestOrigin.DISPATCHED)
    await until(lambda: migrator.history()[0].outcome is MigrationOutcome.FAILED, asyncio.current_task())
    assert failures("UNAVAILABLE") == failed + 1
    await migrator.close()


async def test_an_unanswered_migration_whose_request_the_frontend_resumed_on_the_destination_is_failed():
    """Found by a black-box run: the source froze past the deadline, the frontend resumed the request on the
    destination, and the destination holding it was taken for a commit (the source logged migration_aborted)."""
    committed, failed = counted("committed"), failures("DEADLINE_EXCEEDED")
    settled = await settled_once_the_destination_holds(HeldRequest(RequestOrigin.RESUMED), MigrationOutcome.FAILED,
                                                       "r-10")
    assert "holds the request resumed, not migrated in from a" in settled.message
    assert counted("committed") == committed and failures("DEADLINE_EXCEEDED") == failed + 1


async def test_an_unanswered_migration_an_older_destination_holds_stays_unknown():
    """A destination from before RequestInfo.origin cannot say how it got the request: neither outcome."""
    unknown = counted("unknown")
    migrator, sources, record = await a_loop_migration_unanswered("DEADLINE_EXCEEDED", "r-11")
    sources.held[record.order.dst_address, "r-11"] = HeldRequest(RequestOrigin.UNKNOWN)
    sources.held[record.order.src_address, "r-11"] = HeldRequest(RequestOrigin.DISPATCHED)
    await until(lambda: counted("unknown") == unknown + 1, asyncio.current_task())
    assert migrator.history()[0].outcome is MigrationOutcome.UNKNOWN
    await migrator.close()


async def test_an_unanswered_migration_nobody_can_tell_about_stays_unknown_and_is_counted_once():
    unknown, failed = counted("unknown"), failures("DEADLINE_EXCEEDED")
    migrator, _, _ = await a_loop_migration_unanswered("DEADLINE_EXCEEDED", "r-9")  # finished, on either side
    await until(lambda: counted("unknown") == unknown + 1, asyncio.current_task())
    await asyncio.sleep(2 * LOOKS_AT_S[-1])
    assert migrator.history()[0].outcome is MigrationOutcome.UNKNOWN
    assert counted("unknown") == unknown + 1 and failures("DEADLINE_EXCEEDED") == failed
    await migrator.close()


async def test_an_earlier_move_of_the_request_over_the_same_pair_is_no_commit_of_this_one():
    """Before, the destination holding the request migrated in from this source was taken for this migration's
    commit: an earlier (or later) move of the same request over the same pair counted as it. The source now
    announces the migration's id with its pick and the destination keeps it on the request (RequestInfo)."""
    committed, failed = counted("committed"), failures("DEADLINE_EXCEEDED")
    first_moves_copy = migrated_in_from_a("a-1")
    settled = await settled_once_the_destination_holds(first_moves_copy, MigrationOutcome.FAILED, "r-12", "a-2")
    assert "migrated_in from a by migration a-1, not migrated in by migration a-2" in settled.message
    assert counted("committed") == committed and failures("DEADLINE_EXCEEDED") == failed + 1


async def test_the_copy_of_this_very_migration_is_its_commit():
    committed = counted("committed")
    await settled_once_the_destination_holds(migrated_in_from_a("a-3"), MigrationOutcome.COMMITTED, "r-13", "a-3")
    assert counted("committed") == committed + 1


async def test_an_unanswered_migration_is_journaled_unknown_at_once_and_then_in_its_place():
    """The etcd journal shows an unanswered migration as unknown at once (another manager, or ferryctl through it,
    sees it); what it turned out to be replaces it there."""
    journaled = []
    migrator, sources, record = await a_loop_migration_unanswered(
        "DEADLINE_EXCEEDED", "r-14", "a-4", record_sink=lambda *written: journaled.append(written))
    assert journaled == [(record, None)]
    sources.held[record.order.dst_address, "r-14"] = migrated_in_from_a("a-4")
    await until(lambda: len(journaled) == 2, asyncio.current_task())
    settled, replaced = journaled[1]
    assert settled.is_committed and replaced == record
    await migrator.close()


@pytest.mark.parametrize("leads_again", [False, True])
async def test_a_manager_that_stops_leading_stops_settling_and_counts_the_rest_unknown_writing_nothing(leads_again):
    """Before, the manager that started a migration went on settling it after another took over, and wrote its
    outcome to the shared journal as a non-leader. A manager that leads again (a new term) does not take it up:
    the leader between may have written meanwhile."""
    leadership = Leadership("m-1", "127.0.0.1:1")
    leadership.set_elected(True)
    journaled, unknown, committed = [], counted("unknown"), counted("committed")
    migrator, sources, record = await a_loop_migration_unanswered(
        "DEADLINE_EXCEEDED", "r-15", "a-5", leadership=leadership,
        record_sink=lambda *written: journaled.append(written))
    leadership.set_elected(False)  # another manager leads now
    leadership.set_elected(leads_again)
    sources.held[record.order.dst_address, "r-15"] = migrated_in_from_a("a-5")  # a leader would find it committed
    await until(lambda: counted("unknown") == unknown + 1, asyncio.current_task())
    (kept,) = migrator.history()
    assert kept.outcome is MigrationOutcome.UNKNOWN and "stopped leading" in kept.message
    assert journaled == [(record, None)]  # the journal keeps the unknown record: nothing written since
    await asyncio.sleep(2 * LOOKS_AT_S[-1])
    assert counted("unknown") == unknown + 1 and counted("committed") == committed
    await migrator.close()


async def test_a_manager_that_stops_counts_what_it_still_followed_as_unknown():
    """Before, close() cancelled the settling and the records still unknown were never counted anywhere."""
    unknown = counted("unknown")
    migrator, _, _ = await a_loop_migration_unanswered("UNAVAILABLE", "r-16", "a-6", settle_looks_at_s=(30.0,))
    await migrator.close()
    assert counted("unknown") == unknown + 1
    (kept,) = migrator.history()
    assert kept.outcome is MigrationOutcome.UNKNOWN and "stopped leading (or stopped)" in kept.message


async def test_a_call_that_never_reached_the_source_is_failed_at_once():
    """The connection was refused: no migration started there, so there is nothing to find out."""
    failed, unknown = failures("UNAVAILABLE"), counted("unknown")
    clock = FakeClock()
    view = cluster(clock, a=3, b=0)
    refused = SourceUnreached("MigrateOut on source instance a at 127.0.0.1:1 never reached it")
    refused.__cause__ = RpcCause("UNAVAILABLE")
    migrator = make_migrator(view, clock, FakeSources(refused), settle_looks_at_s=LOOKS_AT_S)
    migrator.tick()
    await settle(migrator)
    (record,) = migrator.history()
    assert (record.outcome, record.reason) == (MigrationOutcome.FAILED, "UNAVAILABLE")
    assert "never reached" in record.message
    assert failures("UNAVAILABLE") == failed + 1 and counted("unknown") == unknown
    await migrator.close()


async def test_a_commit_whose_hand_off_was_lost_is_committed_though_the_frontend_resumed_it():
    """The source froze after the commit, before its hand-off reached the client; the frontend resumed the request
    on the destination, in place of the copy nobody attached to. Before, that settled `failed` (held by a resume);
    the destination now names the migration whose copy the resume replaced, and the migration did commit."""
    committed, failed = counted("committed"), failures("DEADLINE_EXCEEDED")
    resumed_in_place = HeldRequest(RequestOrigin.RESUMED, migration_id="a-7")
    settled = await settled_once_the_destination_holds(resumed_in_place, MigrationOutcome.COMMITTED, "r-17", "a-7")
    assert "resumed in place of the copy migration a-7 committed there" in settled.message
    assert counted("committed") == committed + 1 and failures("DEADLINE_EXCEEDED") == failed


async def test_a_resume_in_place_of_another_migrations_copy_is_no_commit_of_this_one():
    failed = failures("DEADLINE_EXCEEDED")
    resumed_in_place = HeldRequest(RequestOrigin.RESUMED, migration_id="a-1")
    await settled_once_the_destination_holds(resumed_in_place, MigrationOutcome.FAILED, "r-18", "a-8")
    assert failures("DEADLINE_EXCEEDED") == failed + 1


async def test_a_record_followed_right_before_close_is_counted_unknown_too():
    """close() cancelled a settling task that had not run yet: its coroutine never started, so the record was
    never settled (not counted, its `unknown` never noted)."""
    told = []
    order = MigrationOrder(InstanceId("a"), "127.0.0.1:1", InstanceId("b"), "127.0.0.1:2", MigrationTrigger.LOAD)
    record = MigrationRecord(order, MigrationOutcome.UNKNOWN, MigrationFigures("r-17"), 5.0, reason="UNAVAILABLE")
    settler = Settler(FakeSources(), lambda unknown, settled: told.append((unknown, settled)), LOOKS_AT_S,
                      leading_term=lambda: 1)
    settler.follow(record, 1)
    await settler.close()  # no yield between: the task never ran
    ((unknown, settled),) = told
    assert unknown == record and settled.outcome is MigrationOutcome.UNKNOWN and "stopped" in settled.message
