"""The migration loop's records (migrator.py): the history ListMigrations shows, the etcd journal's feed, each
record counted and logged once, and the unanswered ones followed until settled (migration_settle.py).

Records go to the journal (`record_sink`) only while this manager leads in the term their migration began in: a
manager that lost the lead meanwhile writes nothing (the history there is the new leader's). One whose outcome
is unknown is counted once settled; what it turned out to be replaces it in the history, and in the journal while
this manager leads.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import structlog

from services.manager.leadership import Leadership
from services.manager.migration import MigrationOutcome, MigrationRecord
from services.manager.migration_accounting import account
from services.manager.migration_settle import RequestHolders, Settler

log = structlog.get_logger(__name__)

# Gets every kept record (the etcd journal), and what an unknown one turned out to be: (record, the unknown record
# it replaces), the latter only while leading.
RecordSink = Callable[[MigrationRecord, MigrationRecord | None], None]


class MigrationRecords:
    def __init__(self, history_size: int, leadership: Leadership, holders: RequestHolders,
                 settle_looks_at_s: Sequence[float], record_sink: RecordSink | None,
                 on_counted: Callable[[MigrationRecord], None]) -> None:
        self._history: collections.deque[MigrationRecord] = collections.deque(maxlen=history_size)
        self._leadership = leadership
        self._record_sink = record_sink
        self._on_counted = on_counted  # told once per migration, as it is counted (a committed one cools down)
        self._settler = Settler(holders, self._settled, settle_looks_at_s,  # unanswered ones: what became of them
                                leading_term=self.leading_term)

    def leading_term(self) -> int | None:
        return self._leadership.term if self._leadership.is_leader else None

    async def moved_at_once(self, record: MigrationRecord) -> bool:
        """Whether the destination of an unanswered migration holds its request already (Settler.moved_at_once)."""
        return await self._settler.moved_at_once(record)

    def keep(self, record: MigrationRecord, term: int | None, is_followed: bool = True) -> None:
        """In the history, and journaled if this manager still leads in `term` (the one the migration began
        in); counted and logged now, or once settled where its outcome is unknown (and `is_followed`)."""
        self._history.append(record)
        is_in_term = term is not None and term == self.leading_term()
        if self._record_sink is not None and is_in_term:
            self._record_sink(record, None)
        if record.outcome is MigrationOutcome.UNKNOWN and is_followed:
            log.warning("migration_unanswered", request_id=record.figures.request_id, reason=record.reason,
                        src_instance_id=record.order.src_instance_id, dst_instance_id=record.order.dst_instance_id,
                        action="asking the instances whether it committed")
            self._settler.follow(record, term)
            return
        self._account(record)

    def history(self, instance_id: str = "", request_id: str = "") -> list[MigrationRecord]:
        """Kept records, oldest first, optionally only those of one instance or one request."""
        return [r for r in self._history if (not instance_id or r.involves(instance_id))
                and (not request_id or r.figures.request_id == request_id)]

    async def close(self) -> None:
        await self._settler.close()

    def _settled(self, unknown: MigrationRecord, record: MigrationRecord) -> None:
        """What an unanswered migration turned out to be: it replaces its `unknown` record in the history, and
        in the journal while this manager leads (a non-leader writes nothing: the journal keeps it unknown)."""
        with contextlib.suppress(ValueError):  # gone from the history already (a long one): counted all the same
            self._history[self._history.index(unknown)] = record
        is_found_out = record.outcome is not MigrationOutcome.UNKNOWN  # (else the journal has it as it is)
        if is_found_out and self._record_sink is not None and self._leadership.is_leader:
            self._record_sink(record, unknown)
        self._account(record)

    def _account(self, record: MigrationRecord) -> None:
        """Counted and logged (migration_accounting.py), once per migration."""
        account(record)
        self._on_counted(record)
