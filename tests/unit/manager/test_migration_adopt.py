"""Unknown migration records an earlier term left, adopted and settled by the new leader (no sockets).

Before, a leader followed only the unknown records of its own term: those its predecessor left (its shutdown cut a
MigrateOut short, or it lost the lead while it asked) stayed unknown in the journal for good."""

from __future__ import annotations

import asyncio

import pytest

from services.manager import metrics
from services.manager.domain import InstanceId
from services.manager.leadership import Leadership
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationTrigger)
from services.manager.migration_adopt import ADOPT_HORIZON_S, MAX_ADOPTED
from services.manager.migration_settle import HeldRequest, RequestOrigin
from tests.unit.manager.factories import FakeClock
from tests.unit.manager.test_migrator import FakeSources, cluster, make_migrator

pytestmark = pytest.mark.timeout(10)

LOOKS_AT_S = (0.01, 0.02, 0.05)


def left_unknown(request_id: str, migration_id: str = "", dst: str = "b", started_at: float = 4.0) -> MigrationRecord:
    """As the journal hands it back: today's addresses filled in ("" for an instance that left)."""
    address = {"a": "addr-a", "b": "addr-b"}
    order = MigrationOrder(InstanceId("a"), address["a"], InstanceId(dst), address.get(dst, ""), MigrationTrigger.LOAD,
                           request_id=request_id)
    return MigrationRecord(order, MigrationOutcome.UNKNOWN, MigrationFigures(request_id, migration_id=migration_id),
                           started_at, reason="CANCELLED", message="this manager stopped while MigrateOut ran")


class FakeJournal:
    """UnknownRecords and the record sink: hands out `unknown` once per read, keeps what is put."""

    def __init__(self, *unknown: MigrationRecord, error: Exception | None = None) -> None:
        self.unknown = list(unknown)
        self.error = error
        self.reads: list[tuple[float, float, int]] = []
        self.put: list[tuple[MigrationRecord, MigrationRecord | None]] = []

    async def unknown_records(self, started_after, started_before, limit, address_of):
        self.reads.append((started_after, started_before, limit))
        if self.error is not None:
            raise self.error
        return self.unknown

    def append(self, record, replaces=None):
        self.put.append((record, replaces))


def adopted(outcome: str) -> float:
    return metrics.MIGRATIONS_ADOPTED.labels(outcome)._value.get()


def leading(wall_clock: FakeClock) -> Leadership:
    leadership = Leadership("m-2", "127.0.0.1:2", wall_clock=wall_clock)
    leadership.set_elected(True)
    return leadership


async def test_a_new_leader_settles_what_an_earlier_term_left_unknown_in_place():
    clock, wall = FakeClock(), FakeClock(500.0)
    sources = FakeSources()
    sources.held[("addr-b", "r-1")] = HeldRequest(RequestOrigin.MIGRATED_IN, "a", "a-m1")
    journal = FakeJournal(left_unknown("r-1", "a-m1"))
    leadership = leading(wall)
    view = cluster(clock, a=1, b=1)
    migrator = make_migrator(view, clock, sources, leadership=leadership, record_sink=journal.append,
                             journaled=journal, settle_looks_at_s=LOOKS_AT_S)
    before = adopted("committed")
    await migrator._tick_if_leading()
    await migrator._tick_if_leading()  # once per term
    async with asyncio.timeout(3):
        while not journal.put:
            await asyncio.sleep(0.005)
    assert journal.reads == [(500.0 - ADOPT_HORIZON_S, 500.0, MAX_ADOPTED)]  # begun before this term, not long before
    ((record, replaces),) = journal.put
    assert replaces == journal.unknown[0]  # in place of the unknown record
    assert record.outcome is MigrationOutcome.COMMITTED and "from a by migration a-m1" in record.message
    assert adopted("committed") == before + 1
    leadership.set_elected(False)
    wall.advance(60)
    leadership.set_elected(True)  # a new term reads again
    await migrator._tick_if_leading()
    await asyncio.sleep(0.05)
    assert [r[1] for r in journal.reads] == [500.0, 560.0]
    await migrator.close()


async def test_an_adopted_record_is_written_only_while_its_term_leads():
    clock, wall = FakeClock(), FakeClock(500.0)
    sources = FakeSources()  # the destination does not hold it yet
    journal = FakeJournal(left_unknown("r-1", "a-m1"))
    leadership = leading(wall)
    migrator = make_migrator(cluster(clock, a=1, b=1), clock, sources, leadership=leadership,
                             record_sink=journal.append, journaled=journal, settle_looks_at_s=(0.05, 0.1))
    before = adopted("unknown")
    await migrator._tick_if_leading()
    await asyncio.sleep(0.02)
    leadership.set_elected(False)  # lost the lead while it asked
    sources.held[("addr-b", "r-1")] = HeldRequest(RequestOrigin.MIGRATED_IN, "a", "a-m1")
    async with asyncio.timeout(3):
        while adopted("unknown") == before:
            await asyncio.sleep(0.005)
    assert journal.put == []
    await migrator.close()


async def test_records_whose_instances_left_or_a_journal_that_does_not_answer_leave_them_unknown():
    clock, wall = FakeClock(), FakeClock(500.0)
    journal = FakeJournal(left_unknown("r-1", "a-m1", dst="gone"))
    migrator = make_migrator(cluster(clock, a=1, b=1), clock, FakeSources(), leadership=leading(wall),
                             record_sink=journal.append, journaled=journal, settle_looks_at_s=LOOKS_AT_S)
    await migrator._tick_if_leading()
    await asyncio.sleep(0.1)
    assert journal.put == []
    await migrator.close()
    failing = FakeJournal(error=TimeoutError())
    migrator = make_migrator(cluster(clock, a=1, b=1), clock, FakeSources(), leadership=leading(wall),
                             record_sink=failing.append, journaled=failing, settle_looks_at_s=LOOKS_AT_S)
    await migrator._tick_if_leading()  # logged; the loop goes on
    await asyncio.sleep(0.02)
    assert len(failing.reads) == 1 and failing.put == []
    await migrator.close()
