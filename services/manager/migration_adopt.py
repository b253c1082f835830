"""Migration records an earlier term left `unknown`, adopted by the new leader and settled in place.

A leader settles only the unknown records of its own term (migration_settle.py): one whose term ended first (its
shutdown cut a MigrateOut short, or it lost the lead while it asked) leaves them `unknown` in the journal, and the
leader after it followed only its own. So, once per term, as it begins to lead (the migration loop's first tick),
a manager reads the journal's `unknown` records begun before its term and at most ADOPT_HORIZON_S earlier, the
newest MAX_ADOPTED of them with a request id, and settles each as the Settler settles an unanswered migration of
its own: it asks the destination whether it holds the request under that migration's id (the source instance where
the record has none), from when it adopted it, for as long (`looks_at_s`). What it finds out is put over the
record (the same key), only while it still leads in that term; it is counted in
ferry_manager_migrations_adopted_total{outcome}, not again in migrations_total. A record whose instance left
(no address now) or that finds no answer stays `unknown`.

Sound as far as the Settler's own rules are: `committed` by the migration's id is proof; `failed` (the destination
holds the request some other way, or only the source holds it at the last look) assumes the request did not move
again since, which the horizon keeps likely (each committed request also cools down for --migration-cooldown-s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from services.common.error_text import error_text
from services.manager.leadership import Leadership
from services.manager.migration import MigrationOutcome, MigrationRecord
from services.manager.migration_accounting import account_adopted
from services.manager.migration_settle import LOOKS_AT_S, RequestHolders, Settler

log = structlog.get_logger(__name__)

ADOPT_HORIZON_S = 300.0  # records begun at most this long before the term began
MAX_ADOPTED = 64  # per term, the newest first


class UnknownRecords(Protocol):
    async def unknown_records(self, started_after: float, started_before: float, limit: int,
                              address_of: Callable[[str], str]) -> list[MigrationRecord]:
        """The newest `limit` stored unknown records with a request id begun in [started_after, started_before),
        with their instances' addresses (`address_of`); raises if the store does not answer."""


RecordSink = Callable[[MigrationRecord, MigrationRecord | None], None]


class Adopter:
    def __init__(self, records: UnknownRecords, holders: RequestHolders, leadership: Leadership,
                 address_of: Callable[[str], str], record_sink: RecordSink | None,
                 looks_at_s: Sequence[float] = LOOKS_AT_S) -> None:
        self._records = records
        self._leadership = leadership
        self._address_of = address_of  # an instance's address now, "" if it left
        self._record_sink = record_sink  # (what it turned out to be, the unknown record it replaces)
        self._settler = Settler(holders, self._settled, looks_at_s, leading_term=self._leading_term)
        self._adopted_term = 0  # the last term whose records were read (terms count from 1)
        self._task: asyncio.Task[None] | None = None

    def adopt_once_per_term(self) -> None:
        """While leading, once per term: read the earlier terms' unknown records and follow them (background)."""
        term = self._leading_term()
        if term is None or term == self._adopted_term:
            return
        self._adopted_term = term
        self._task = asyncio.get_running_loop().create_task(self._adopt(term, self._leadership.elected_at),
                                                            name="adopt_unknown_migrations")

    async def close(self) -> None:
        """Stop: the records still followed stay unknown (nothing is written)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._settler.close()

    async def _adopt(self, term: int, elected_at: float) -> None:
        try:
            records = await self._records.unknown_records(elected_at - ADOPT_HORIZON_S, elected_at, MAX_ADOPTED,
                                                          self._address_of)
        except Exception as exc:  # noqa: BLE001 — etcd away: those records stay unknown (as before this term)
            log.warning("migration_records_not_adopted", term=term, error=error_text(exc))
            return
        reachable = [r for r in records if r.order.src_address and r.order.dst_address]
        for record in reachable:
            self._settler.follow(record, term)
        if records:
            log.info("migration_records_adopted", term=term, num_records=len(reachable),
                     num_left_unknown=len(records) - len(reachable))

    def _settled(self, unknown: MigrationRecord, record: MigrationRecord) -> None:
        is_found_out = record.outcome is not MigrationOutcome.UNKNOWN
        if is_found_out and self._record_sink is not None and self._leadership.is_leader:
            self._record_sink(record, unknown)
        account_adopted(record)

    def _leading_term(self) -> int | None:
        return self._leadership.term if self._leadership.is_leader else None
