"""Migrations whose source gave no answer (UNAVAILABLE, DEADLINE_EXCEEDED): found out by asking the instances.

A source that froze, died or outlasted the manager's deadline may have committed anyway: its migration runs on as a
task of its own once the caller gave up (services/instance/migration.py), so the destination can take the request
after the deadline. Unless the destination holds the request at once (`moved_at_once`: committed), such a migration
is kept as `unknown` (in the history, and in the etcd journal, at once) and then looked at with backoff
(`looks_at_s`, from when the call ended), by asking the destination whether it holds the request (ListRequests).
The source names its pick and the migration's id in MigrateOut's initial metadata
(services/common/pick_announcement.py), so a loop migration's request is known too, and the destination's answer is
matched to this very migration (RequestInfo.migration_id), not to an earlier or later move of the same request over
the same pair. It is `committed` once the destination holds it under this migration's id (also where the frontend's
resume replaced the copy this migration committed there, whose hand-off never reached the client); `failed` once
the destination holds it another way (the frontend resumed it there after the source stopped answering: a commit of
it is refused there from then on; or another migration brought it), or at the last look if the source still holds
it and the destination does not; otherwise (it finished meanwhile, no instance answered, the request is not known,
or a destination from before RequestInfo.origin holds it) it stays `unknown`. Where either side is from before
RequestInfo.migration_id, a request migrated in from this migration's source counts as its commit.

Only the leader finds out, in the term its migration began in: a manager that stops leading (or stops) settles what
it still follows as `unknown` at once, so each is counted once and none is lost, and leaves the journal's `unknown`
record as it is (a non-leader writes nothing; the next leader adopts it: migration_adopt.py). Bounded: at most
MAX_UNSETTLED followed at once (one more is settled `unknown` at once), each looked at len(looks_at_s) times at most.

A call that never reached the source (`SourceUnreached`: the connection was refused) started nothing there: it is
`failed` at once, not unanswered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.common.errors import FerryError, Unavailable
from services.manager.migration import MigrationOrder, MigrationOutcome, MigrationRecord

log = structlog.get_logger(__name__)

UNANSWERED_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # the source gave no answer: it may have committed
UNANSWERED_CHECK_TIMEOUT_S = 2.0  # one ListRequests asking an instance whether it holds the request
LOOKS_AT_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # after the call ended
MAX_UNSETTLED = 64
NOT_LEADING = "not found out: this manager stopped leading (or stopped) first"


class SourceUnanswered(Unavailable):
    """MigrateOut's source gave no answer (UNAVAILABLE, DEADLINE_EXCEEDED) after the call reached it: it may have
    committed. `request_id` and `migration_id`: its pick as it announced it ("" where it did not)."""

    def __init__(self, message: str, request_id: str = "", migration_id: str = "") -> None:
        super().__init__(message, request_id)
        self.migration_id = migration_id


class SourceUnreached(Unavailable):
    """MigrateOut never reached the source (its connection was refused): no migration started there."""


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
    # MIGRATED_IN: that migration's id ("" from an instance from before the field); RESUMED: the migration whose
    # committed copy, which no client attached to (its hand-off was lost), the frontend's resume replaced
    migration_id: str = ""

    def is_committed_by(self, order: MigrationOrder, migration_id: str) -> bool:
        """Whether the migration `migration_id` (as its source announced it; "" if it did not) committed this
        copy, or the one a resume replaced; by the source instance where either side does not know the id."""
        if migration_id and self.migration_id:
            return self.migration_id == migration_id and self.origin in (RequestOrigin.MIGRATED_IN,
                                                                         RequestOrigin.RESUMED)
        return self.origin is RequestOrigin.MIGRATED_IN and self.migrated_from == order.src_instance_id

    def is_not_committed_by(self, order: MigrationOrder, migration_id: str) -> bool:
        """Held some other way: this migration can no longer commit there (a request is adopted only once)."""
        return self.origin is not RequestOrigin.UNKNOWN and not self.is_committed_by(order, migration_id)

    def describe(self) -> str:
        if self.origin is RequestOrigin.RESUMED and self.migration_id:
            return (f"resumed in place of the copy migration {self.migration_id} committed there (its hand-off "
                    "never reached the client)")
        if self.origin is not RequestOrigin.MIGRATED_IN:
            return self.origin.value
        return f"{self.origin.value} from {self.migrated_from or '?'}" + (
            f" by migration {self.migration_id}" if self.migration_id else "")


class RequestHolders(Protocol):
    async def held_request(self, address: str, request_id: str, timeout_s: float) -> HeldRequest | None:
        """The request on the instance, unfinished; None if it has none (FerryError if it does not answer)."""


def this_migration(record: MigrationRecord) -> str:
    migration_id = record.figures.migration_id
    if migration_id:
        return f"migrated in by migration {migration_id}"
    return f"migrated in from {record.order.src_instance_id}"


class Settler:
    def __init__(self, holders: RequestHolders, on_settled: Callable[[MigrationRecord, MigrationRecord], None],
                 looks_at_s: Sequence[float] = LOOKS_AT_S, leading_term: Callable[[], int | None] = lambda: 0) -> None:
        self._holders = holders
        self._on_settled = on_settled  # (the unknown record, what it turned out to be); told once per record
        self._looks_at_s = looks_at_s
        # This manager's term while it leads, else None: only the leader finds out, and only in the term that kept
        # the record (a manager that stopped leading, even if it leads again since, stops looking)
        self._leading_term = leading_term
        self._tasks: set[asyncio.Task[None]] = set()
        self._unsettled: set[MigrationRecord] = set()  # followed, `on_settled` not told yet

    async def moved_at_once(self, record: MigrationRecord) -> bool:
        """Whether the destination holds the request right after the source gave no answer (it froze or died
        after the commit): then it is committed, and no more needs finding out."""
        order, figures = record.order, record.figures
        held = await self._held(order.dst_address, figures.request_id) if figures.request_id else None
        if held is None or not held.is_committed_by(order, figures.migration_id):
            return False
        log.warning("migration_unanswered_but_moved", request_id=figures.request_id,
                    migration_id=figures.migration_id, src_instance_id=order.src_instance_id,
                    dst_instance_id=order.dst_instance_id, error=record.message)
        return True

    def follow(self, record: MigrationRecord, term: int | None) -> None:
        """Find out what became of `record` (outcome unknown) in the background; `on_settled` is told.
        `term`: the leading term its migration began in (None: not leading then); unless this manager still
        leads in it, it stays unknown."""
        if term is None or term != self._leading_term():
            return self._settled(record, MigrationOutcome.UNKNOWN, NOT_LEADING)
        if not record.figures.request_id or len(self._tasks) >= MAX_UNSETTLED:
            self._on_settled(record, record)  # nothing to ask about (or too many at once): unknown it stays
            return
        task = asyncio.get_running_loop().create_task(self._settle(record, term),
                                                      name=f"settle:{record.figures.request_id}")
        self._tasks.add(task)
        self._unsettled.add(record)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop looking: each record still followed is settled `unknown` (counted, not lost)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for record in list(self._unsettled):  # its task was cancelled before it first ran: _settle never saw it
            self._settled(record, MigrationOutcome.UNKNOWN, NOT_LEADING)

    async def _settle(self, record: MigrationRecord, term: int) -> None:
        try:
            outcome, note = await self._find_out(record, term)
        except asyncio.CancelledError:
            self._settled(record, MigrationOutcome.UNKNOWN, NOT_LEADING)
            raise
        if self._leading_term() != term:  # lost the lead while it asked
            outcome, note = MigrationOutcome.UNKNOWN, NOT_LEADING
        self._settled(record, outcome, note)

    async def _find_out(self, record: MigrationRecord, term: int) -> tuple[MigrationOutcome, str]:
        order, request_id, migration_id = record.order, record.figures.request_id, record.figures.migration_id
        waited_s, held = 0.0, None
        for look_at_s in self._looks_at_s:
            await asyncio.sleep(look_at_s - waited_s)
            waited_s = look_at_s
            if self._leading_term() != term:
                return MigrationOutcome.UNKNOWN, NOT_LEADING
            held = await self._held(order.dst_address, request_id)
            if held is not None and held.is_committed_by(order, migration_id):
                return MigrationOutcome.COMMITTED, (f"committed after all: the destination holds the request "
                                                    f"{held.describe()}")
            if held is not None and held.is_not_committed_by(order, migration_id):
                return MigrationOutcome.FAILED, (f"not committed: the destination holds the request "
                                                 f"{held.describe()}, not {this_migration(record)}")
        if held is None and await self._held(order.src_address, request_id) is not None:
            return MigrationOutcome.FAILED, ("not committed: the source still holds the request and the destination "
                                             "does not")
        return MigrationOutcome.UNKNOWN, ""

    async def _held(self, address: str, request_id: str) -> HeldRequest | None:
        try:
            return await self._holders.held_request(address, request_id, UNANSWERED_CHECK_TIMEOUT_S)
        except FerryError:
            return None  # no answer: look again (or stay unknown)

    def _settled(self, record: MigrationRecord, outcome: MigrationOutcome, note: str) -> None:
        self._unsettled.discard(record)
        message = f"{note} ({record.message})" if note else record.message
        reason = "" if outcome is MigrationOutcome.COMMITTED else record.reason
        self._on_settled(record, dataclasses.replace(record, outcome=outcome, reason=reason, message=message))
