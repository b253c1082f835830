"""Migrations whose source gave no answer (UNAVAILABLE, DEADLINE_EXCEEDED): found out by asking the instances.

A source that froze, died or outlasted the manager's deadline may have committed anyway: its migration runs on
as a task of its own once the caller gave up (services/instance/migration.py), so the destination can take the
request after the deadline. Unless the destination holds the request at once (`moved_at_once`: committed), such
a migration is kept as `unknown` (in the history at once) and then looked at
with backoff (`looks_at_s`, from when the call ended), by asking the destination whether it holds the request
(ListRequests; the source names its pick in MigrateOut's initial metadata, so a loop migration's request is known
too). It is `committed` once the destination holds it migrated in from this source; `failed` once the
destination holds it another way (the frontend resumed it there after the source stopped answering: a commit of
it is refused there from then on), or at the last look if the source still holds it and the destination does
not; otherwise (it finished meanwhile, no instance answered, the request is not known, or a destination from
before RequestInfo.origin holds it) it stays `unknown`. Bounded: at most MAX_UNSETTLED followed at once (one more is settled `unknown` at once),
each looked at len(looks_at_s) times at most.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.common.errors import FerryError
from services.manager.migration import MigrationOrder, MigrationOutcome, MigrationRecord

log = structlog.get_logger(__name__)

UNANSWERED_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # the source gave no answer: it may have committed
UNANSWERED_CHECK_TIMEOUT_S = 2.0  # one ListRequests asking an instance whether it holds the request
LOOKS_AT_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # after the call ended
MAX_UNSETTLED = 64


class RequestOrigin(enum.Enum):
    """How an instance came to hold a request (RequestInfo.origin)."""

    UNKNOWN = "unknown"  # an instance from before the field
    DISPATCHED = "dispatched"
    RESUMED = "resumed"  # the frontend's failover (after a source stopped answering, say)
    MIGRATED_IN = "migrated_in"


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """An unfinished request on an instance, and how it came there."""

    origin: RequestOrigin
    migrated_from: str = ""  # with MIGRATED_IN: the migration's source instance id

    def is_committed_by(self, order: MigrationOrder) -> bool:
        return self.origin is RequestOrigin.MIGRATED_IN and self.migrated_from == order.src_instance_id

    def is_not_committed_by(self, order: MigrationOrder) -> bool:
        """Held some other way: this migration can no longer commit there (a request is adopted only once)."""
        return self.origin is not RequestOrigin.UNKNOWN and not self.is_committed_by(order)

    def describe(self) -> str:
        source = f" from {self.migrated_from or '?'}" if self.origin is RequestOrigin.MIGRATED_IN else ""
        return f"{self.origin.value}{source}"


class RequestHolders(Protocol):
    async def held_request(self, address: str, request_id: str, timeout_s: float) -> HeldRequest | None:
        """The request on the instance, unfinished; None if it has none (FerryError if it does not answer)."""


class Settler:
    def __init__(self, holders: RequestHolders, on_settled: Callable[[MigrationRecord, MigrationRecord], None],
                 looks_at_s: Sequence[float] = LOOKS_AT_S) -> None:
        self._holders = holders
        self._on_settled = on_settled  # (the unknown record, what it turned out to be)
        self._looks_at_s = looks_at_s
        self._tasks: set[asyncio.Task[None]] = set()

    async def moved_at_once(self, order: MigrationOrder, request_id: str, error: str) -> bool:
        """Whether the destination holds the request right after the source gave no answer (it froze or died
        after the commit): then it is committed, and no more needs finding out."""
        held = await self._held(order.dst_address, request_id) if request_id else None
        if held is None or not held.is_committed_by(order):
            return False
        log.warning("migration_unanswered_but_moved", request_id=request_id, src_instance_id=order.src_instance_id,
                    dst_instance_id=order.dst_instance_id, error=error)
        return True

    def follow(self, record: MigrationRecord) -> None:
        """Find out what became of `record` (outcome unknown) in the background; `on_settled` is told."""
        if not record.figures.request_id or len(self._tasks) >= MAX_UNSETTLED:
            self._on_settled(record, record)  # nothing to ask about (or too many at once): unknown it stays
            return
        task = asyncio.get_running_loop().create_task(self._settle(record),
                                                      name=f"settle:{record.figures.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _settle(self, record: MigrationRecord) -> None:
        order, request_id = record.order, record.figures.request_id
        waited_s, held = 0.0, None
        for look_at_s in self._looks_at_s:
            await asyncio.sleep(look_at_s - waited_s)
            waited_s = look_at_s
            held = await self._held(order.dst_address, request_id)
            if held is not None and held.is_committed_by(order):
                return self._settled(record, MigrationOutcome.COMMITTED, "committed after all: the destination holds "
                                     f"the request migrated in from {order.src_instance_id}")
            if held is not None and held.is_not_committed_by(order):
                return self._settled(record, MigrationOutcome.FAILED, "not committed: the destination holds the "
                                     f"request {held.describe()}, not migrated in from {order.src_instance_id}")
        if held is None and await self._held(order.src_address, request_id) is not None:
            return self._settled(record, MigrationOutcome.FAILED, "not committed: the source still holds the request "
                                 "and the destination does not")
        self._settled(record, MigrationOutcome.UNKNOWN, record.message)

    async def _held(self, address: str, request_id: str) -> HeldRequest | None:
        try:
            return await self._holders.held_request(address, request_id, UNANSWERED_CHECK_TIMEOUT_S)
        except FerryError:
            return None  # no answer: look again (or stay unknown)

    def _settled(self, record: MigrationRecord, outcome: MigrationOutcome, note: str) -> None:
        message = record.message if outcome is MigrationOutcome.UNKNOWN else f"{note} ({record.message})"
        reason = "" if outcome is MigrationOutcome.COMMITTED else record.reason
        self._on_settled(record, dataclasses.replace(record, outcome=outcome, reason=reason, message=message))
