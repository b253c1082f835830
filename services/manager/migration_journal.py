"""Migration records in etcd, so the history outlives the leader that kept it.

| key                                                 | value                                  |
|-----------------------------------------------------|----------------------------------------|
| /ferry/<cluster>/migrations/<started_at ns>-<manager>-<n> | a serialized ferry.v1.MigrationRecord |

Keys sort by start time (20-digit nanoseconds), so a range read is the history oldest
first. The leader appends each record it keeps (its migrations and the PD hand-offs
instances report); one writer task puts them, so a slow or absent etcd never holds a
migration up: the queue is bounded and a record that finds it full, or whose put fails,
is only logged (the leader's in-memory history still has it). A migration whose source gave
no answer is put `unknown` at once, and what it turned out to be is put under the same key
(migration_settle.py). After each put the oldest keys beyond `--migration-history-size` are
deleted. Keys have no lease: a new leader, and ferryctl through any manager, read the same history.
A manager puts only records of migrations begun in its current term as leader (migrator.py), each in a
transaction that checks the leader key is still the one of the term that appended it (`LeaderFence`: a put
queued before the lead was lost lands nowhere, not over a newer leader's record); at shutdown it flushes the
queue, within FLUSH_TIMEOUT_S, before it resigns. A new leader reads the `unknown` records
an earlier term left, to settle them in place (`unknown_records`, migration_adopt.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from etcd3aio import Etcd3Client, SortOrder, prefix_range_end
from etcd3aio.kv import KVService

from services.common.error_text import typed_error_text
from services.common.gen.ferry.v1 import manager_pb2
from services.manager import convert
from services.manager.migration import MigrationOutcome, MigrationRecord

log = structlog.get_logger(__name__)

ETCD_TIMEOUT_S = 2.0
QUEUE_SIZE = 256
MAX_UNKNOWN_KEYS = 256  # keys of unknown records kept for their replacement
FLUSH_TIMEOUT_S = 2.0  # at shutdown: the records still queued get this long


@dataclass(frozen=True, slots=True)
class LeaderFence:
    """The election's leader key, and this manager's epoch (the key's create revision) while it leads, else None."""

    key: str
    epoch: Callable[[], int | None]


Queued = tuple[MigrationRecord, MigrationRecord | None, int | None]  # (record, the one it replaces, epoch)


class MigrationJournal:
    def __init__(self, client: Etcd3Client, cluster: str, manager_id: str, size: int,
                 fence: LeaderFence | None = None) -> None:
        self._client = client
        self._prefix = f"/ferry/{cluster}/migrations/"
        self._manager_id = manager_id
        self._size = size
        self._fence = fence  # None: every record is put (tests)
        self._queue: asyncio.Queue[Queued] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._sequence = itertools.count()
        self._unknown_keys: dict[MigrationRecord, str] = {}  # the key of each unknown record put, till it is replaced

    def append(self, record: MigrationRecord, replaces: MigrationRecord | None = None) -> None:
        """Queue `record` for etcd, in place of the unknown record `replaces` if given; never blocks. With a fence,
        it is put only while the leader key is still the one of the term that appended it."""
        epoch = self._fence.epoch() if self._fence is not None else None
        if self._fence is not None and epoch is None:
            log.info("migration_record_not_journaled", request_id=record.figures.request_id, reason="not leading")
            return
        try:
            self._queue.put_nowait((record, replaces, epoch))
        except asyncio.QueueFull:
            log.warning("migration_journal_full", request_id=record.figures.request_id, queued=QUEUE_SIZE)

    async def writer_loop(self) -> None:
        """Put queued records, one at a time, forever; a failed put loses only that record."""
        while True:
            record, replaces, epoch = await self._queue.get()
            try:
                if await self._put(record, replaces, epoch):
                    await self._trim()
            except Exception as exc:  # noqa: BLE001 — etcd down or refusing: the record stays in memory only
                log.warning("migration_journal_write_failed", request_id=record.figures.request_id,
                            error=typed_error_text(exc))
            finally:
                self._queue.task_done()

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until the records queued so far are written (or failed), for at most `timeout_s`: at shutdown,
        while writer_loop still runs and this manager still leads. What is left unwritten is logged."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
        except TimeoutError:
            log.warning("migration_journal_unflushed", num_records=self._queue.qsize(), timeout_s=timeout_s)

    async def history(self, recent: list[MigrationRecord]) -> list[manager_pb2.MigrationRecord]:
        """The newest `size` of the stored history and this manager's `recent` records, oldest first; a
        recent one in place of its stored copy (an unknown one settled since, not rewritten yet). Raises one
        of ETCD_ERRORS if etcd does not answer."""
        fresh = [convert.migration_record_to_proto(r) for r in recent]
        seen = {_identity(record) for record in fresh}
        stored = [r for r in await self.read() if _identity(r) not in seen]
        return sorted(stored + fresh, key=lambda record: record.started_at)[-self._size:]

    async def read(self) -> list[manager_pb2.MigrationRecord]:
        """The stored history, oldest first (raises one of ETCD_ERRORS if etcd does not answer)."""
        return [record for _, record in await self._read_keyed()]

    async def unknown_records(self, started_after: float, started_before: float, limit: int,
                              address_of: Callable[[str], str]) -> list[MigrationRecord]:
        """The newest `limit` stored `unknown` records with a request id begun in [started_after, started_before),
        with their instances' addresses now (`address_of`: "" if gone); what becomes of each is put in its place
        (`append(settled, replaces=it)`). Raises one of ETCD_ERRORS if etcd does not answer."""
        found = []
        for key, msg in reversed(await self._read_keyed()):
            if (msg.outcome != MigrationOutcome.UNKNOWN.value or not msg.request_id
                    or not started_after <= msg.started_at < started_before):
                continue
            try:
                record = convert.journaled_migration_from_proto(msg, address_of(msg.src_instance_id),
                                                                address_of(msg.dst_instance_id))
            except ValueError:  # an unknown trigger (a newer manager's): left as it is
                continue
            self._keep_unknown_key(record, key)
            found.append(record)
            if len(found) >= limit:
                break
        return found

    async def _read_keyed(self) -> list[tuple[str, manager_pb2.MigrationRecord]]:
        reply = await self._client.kv.get(self._prefix, range_end=prefix_range_end(self._prefix),
                                          sort_order=SortOrder.ASCEND, timeout=ETCD_TIMEOUT_S)
        return [(kv.key.decode(), manager_pb2.MigrationRecord.FromString(kv.value)) for kv in reply.kvs]

    async def _put(self, record: MigrationRecord, replaces: MigrationRecord | None, epoch: int | None) -> bool:
        """Put `record` (False where the fence refused it: another term leads now)."""
        key = self._unknown_keys.pop(replaces, None) if replaces is not None else None
        if key is None:  # (the unknown one's put failed, or was forgotten: a key of its own)
            key = f"{self._prefix}{int(record.started_at * 1e9):020d}-{self._manager_id}-{next(self._sequence)}"
        value = convert.migration_record_to_proto(record).SerializeToString()
        if not await self._put_fenced(key, value, epoch):
            log.info("migration_record_not_journaled", request_id=record.figures.request_id, epoch=epoch,
                     reason="the leader key is no longer this term's: another term leads")
            return False
        if record.outcome is MigrationOutcome.UNKNOWN:
            self._keep_unknown_key(record, key)
        return True

    async def _put_fenced(self, key: str, value: bytes, epoch: int | None) -> bool:
        if self._fence is None or epoch is None:
            await self._client.kv.put(key, value, timeout=ETCD_TIMEOUT_S)
            return True
        txn = await self._client.kv.txn(compare=[KVService.txn_compare_create_revision(self._fence.key, epoch)],
                                        success=[KVService.txn_op_put(key, value)], timeout=ETCD_TIMEOUT_S)
        return txn.succeeded

    def _keep_unknown_key(self, record: MigrationRecord, key: str) -> None:
        self._unknown_keys[record] = key
        while len(self._unknown_keys) > MAX_UNKNOWN_KEYS:  # never replaced (settled by a manager that lost)
            del self._unknown_keys[next(iter(self._unknown_keys))]

    async def _trim(self) -> None:
        end = prefix_range_end(self._prefix)
        count = (await self._client.kv.get(self._prefix, range_end=end, count_only=True, timeout=ETCD_TIMEOUT_S)).count
        if count <= self._size:
            return
        oldest = await self._client.kv.get(self._prefix, range_end=end, keys_only=True, limit=count - self._size,
                                           sort_order=SortOrder.ASCEND, timeout=ETCD_TIMEOUT_S)
        await self._client.kv.delete(self._prefix, range_end=oldest.kvs[-1].key + b"\0", timeout=ETCD_TIMEOUT_S)


def _identity(record: manager_pb2.MigrationRecord) -> tuple:
    return record.started_at, record.request_id, record.src_instance_id, record.dst_instance_id
