"""Migrations whose source gave no answer: kept as unknown, then found out from the instances (no sockets).

Before, a MigrateOut that answered DEADLINE_EXCEEDED (or UNAVAILABLE) was recorded failed, and counted as a
failure, unless the destination held the request at that very moment; but the source's migration runs on after
the caller's deadline and may commit later, and a loop migration's request was not even known to ask about."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Unavailable
from services.manager import metrics
from services.manager.migration import MigrationOutcome, MigrationTrigger
from services.manager.migration_settle import HeldRequest, RequestOrigin
from tests.unit.loop_checks import until
from tests.unit.manager.factories import FakeClock
from tests.unit.manager.test_migrator import (MIGRATED_IN_FROM_A, FakeSources, RpcCause, cluster, make_migrator,
                                              routes, settle)

pytestmark = pytest.mark.timeout(10)

LOOKS_AT_S = (0.01, 0.02, 0.05)


def unanswered(status: str, request_id: str) -> Unavailable:
    """What the manager's client raises: the source named its pick in the call's initial metadata."""
    error = Unavailable("MigrateOut on source instance a: Deadline Exceeded", request_id=request_id)
    error.__cause__ = RpcCause(status)
    return error


def counted(outcome: str, trigger: str = "load") -> float:
    return metrics.MIGRATIONS.labels(outcome, trigger)._value.get()


def failures(reason: str) -> float:
    return metrics.MIGRATION_FAILURES.labels(reason)._value.get()


async def a_loop_migration_unanswered(status: str, request_id: str):
    clock = FakeClock()
    view = cluster(clock, a=3, b=0)
    sources = FakeSources(unanswered(status, request_id))
    migrator = make_migrator(view, clock, sources, settle_looks_at_s=LOOKS_AT_S)
    assert routes(migrator.tick()) == [("a", "b", MigrationTrigger.LOAD)]
    await settle(migrator)
    (record,) = migrator.history()
    assert record.outcome is MigrationOutcome.UNKNOWN, f"recorded {record.outcome.value} before anyone could tell"
    assert record.figures.request_id == request_id and record.reason == status
    return migrator, sources, record


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
    migrator, sources, record = await a_loop_migration_unanswered("DEADLINE_EXCEEDED", "r-10")
    sources.held[record.order.dst_address, "r-10"] = HeldRequest(RequestOrigin.RESUMED)
    await until(lambda: migrator.history()[0].outcome is MigrationOutcome.FAILED, asyncio.current_task())
    assert "holds the request resumed, not migrated in from a" in migrator.history()[0].message
    assert counted("committed") == committed and failures("DEADLINE_EXCEEDED") == failed + 1
    await migrator.close()


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
