"""The migration history in etcd (real etcd): bounded, ordered, shared by every manager,
merged with what the leader has not written yet, and never in the way of a migration."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from services.common.etcd_client import ETCD_ERRORS, connect_etcd
from services.manager.domain import InstanceId
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationTrigger)
from services.manager.migration_journal import LeaderFence, MigrationJournal

pytestmark = pytest.mark.timeout(60)

SIZE = 5  # records kept


def record(n: int, outcome: MigrationOutcome = MigrationOutcome.COMMITTED) -> MigrationRecord:
    order = MigrationOrder(InstanceId(f"i{n % 2}"), "127.0.0.1:1", InstanceId(f"i{1 - n % 2}"), "127.0.0.1:2",
                           MigrationTrigger.LOAD)
    return MigrationRecord(order, outcome, MigrationFigures(f"req-{n}", num_blocks=n, num_bytes=n * 1024),
                           started_at=1_700_000_000.0 + n)


@pytest.fixture
async def client(etcd):
    client = await connect_etcd([etcd.endpoint])
    yield client
    await client.close()


@pytest.fixture
async def journal(client, cluster):
    journal = MigrationJournal(client, cluster, "manager-0", size=SIZE)
    writer = asyncio.create_task(journal.writer_loop())
    yield journal
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)


async def stored_ids(journal: MigrationJournal, until_last: str, timeout_s: float = 15) -> list[str]:
    """The stored request ids, once the newest is `until_last` and the oldest beyond SIZE are gone
    (the writer deletes them after the put, so a read between the two sees one too many; etcd
    errors meanwhile are retried)."""
    deadline = time.monotonic() + timeout_s
    ids = []
    while True:
        try:
            ids = [r.request_id for r in await journal.read()]
            if ids and ids[-1] == until_last and len(ids) <= SIZE:
                return ids
        except ETCD_ERRORS:
            pass
        assert time.monotonic() < deadline, f"{until_last} never stored, or never trimmed to {SIZE}: {ids}"
        await asyncio.sleep(0.05)


async def test_the_newest_records_stay_oldest_first_and_another_manager_reads_them(journal, client, cluster):
    for n in range(8):
        journal.append(record(n))
    assert await stored_ids(journal, "req-7") == [f"req-{n}" for n in range(3, 8)]
    newest = (await journal.read())[-1]
    assert (newest.num_bytes, newest.outcome, newest.trigger, newest.src_instance_id) == (7 * 1024, "committed",
                                                                                         "load", "i1")
    other_manager = MigrationJournal(client, cluster, "manager-1", size=SIZE)
    assert [r.request_id for r in await other_manager.read()] == [f"req-{n}" for n in range(3, 8)]


async def test_history_adds_the_records_not_written_yet_once(journal):
    journal.append(record(1))
    await stored_ids(journal, "req-1")
    merged = await journal.history([record(1), record(2, MigrationOutcome.FAILED)])  # 2 is not written
    assert [(r.request_id, r.outcome) for r in merged] == [("req-1", "committed"), ("req-2", "failed")]
    newest = await journal.history([record(n) for n in range(2, 9)])  # more than the 5 kept
    assert [r.request_id for r in newest] == [f"req-{n}" for n in range(4, 9)]


async def test_a_paused_etcd_loses_a_record_not_the_writer(journal, etcd):
    etcd.pause()
    try:
        journal.append(record(1))
        with pytest.raises(ETCD_ERRORS):
            await journal.read()
    finally:
        etcd.resume()
    journal.append(record(2))
    assert (await stored_ids(journal, "req-2"))[-1] == "req-2"


async def test_an_unknown_record_is_replaced_in_place_by_what_it_turned_out_to_be(journal):
    """An unanswered migration is journaled unknown at once (a new leader sees it) and its outcome, once found
    out, replaces it: one record, not an unknown one and a committed one side by side."""
    unknown = record(1, MigrationOutcome.UNKNOWN)
    journal.append(unknown)
    await stored_ids(journal, "req-1")
    assert [r.outcome for r in await journal.read()] == ["unknown"]
    settled = dataclasses.replace(unknown, outcome=MigrationOutcome.COMMITTED, message="committed after all")
    assert [(r.request_id, r.outcome) for r in await journal.history([settled])] == [("req-1", "committed")]
    journal.append(settled, replaces=unknown)
    journal.append(record(2))
    await stored_ids(journal, "req-2")
    assert [(r.request_id, r.outcome) for r in await journal.read()] == [("req-1", "committed"), ("req-2", "committed")]


async def test_a_new_leader_reads_the_unknown_records_an_earlier_one_left_and_settles_them_in_place(
        journal, client, cluster):
    def left(n: int, outcome: MigrationOutcome = MigrationOutcome.UNKNOWN, request_id: str | None = None):
        kept = record(n, outcome)
        figures = dataclasses.replace(kept.figures, migration_id=f"i0-m{n}",
                                      request_id=kept.figures.request_id if request_id is None else request_id)
        return dataclasses.replace(kept, figures=figures, reason="CANCELLED")

    for kept in (left(1), left(2, MigrationOutcome.FAILED), left(3, request_id=""), left(4), left(5)):
        journal.append(kept)
    await stored_ids(journal, "req-5")
    next_leader = MigrationJournal(client, cluster, "manager-1", size=SIZE)
    addresses = {"i0": "10.0.0.1:50", "i1": "10.0.0.2:50"}
    found = await next_leader.unknown_records(1_700_000_000.5, 1_700_000_005.0, 10, addresses.get)  # not 5
    assert [(r.figures.request_id, r.figures.migration_id) for r in found] == [("req-4", "i0-m4"), ("req-1", "i0-m1")]
    assert (found[0].order.src_address, found[0].order.dst_address, found[0].reason) == (
        "10.0.0.1:50", "10.0.0.2:50", "CANCELLED")
    assert [r.figures.request_id for r in await next_leader.unknown_records(0, 2e9, 1, addresses.get)] == ["req-5"]
    writer = asyncio.create_task(next_leader.writer_loop())
    try:
        next_leader.append(dataclasses.replace(found[0], outcome=MigrationOutcome.COMMITTED), replaces=found[0])
        await next_leader.flush()
    finally:
        writer.cancel()
    assert [(r.request_id, r.outcome) for r in await journal.read()] == [
        ("req-1", "unknown"), ("req-2", "failed"), ("", "unknown"), ("req-4", "committed"), ("req-5", "unknown")]


async def test_a_record_is_put_only_while_the_term_that_appended_it_leads(client, cluster):
    """The leader checked its term when it kept a record, but the put came later from the queue: one queued before it
    lost the lead landed after, maybe over what the next leader had put under the same key."""
    leader_key = f"/ferry/{cluster}/manager/leader"
    await client.kv.put(leader_key, "m-0")
    epoch = (await client.kv.get(leader_key)).kvs[0].create_revision
    epochs = [epoch]
    journal = MigrationJournal(client, cluster, "m-0", size=SIZE, fence=LeaderFence(leader_key, lambda: epochs[-1]))
    journal.append(record(1))
    journal.append(record(2))  # queued in the term, put after it ended
    await client.kv.delete(leader_key)
    await client.kv.put(leader_key, "m-1")  # another term
    epochs.append(None)
    journal.append(record(3))  # not leading: not even queued
    writer = asyncio.create_task(journal.writer_loop())
    try:
        await journal.flush()
    finally:
        writer.cancel()
    assert await journal.read() == []
    epochs.append((await client.kv.get(leader_key)).kvs[0].create_revision)  # this manager leads again
    journal.append(record(4))
    writer = asyncio.create_task(journal.writer_loop())
    try:
        await journal.flush()
    finally:
        writer.cancel()
    assert [r.request_id for r in await journal.read()] == ["req-4"]
