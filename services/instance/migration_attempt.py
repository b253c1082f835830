"""One migration out in flight (MigrationDriver): what it moved so far, and its engine calls on the copy of
the request it moves, never on a copy that took the id since (a resume of the request here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from services.common.errors import Aborted, NotFound
from services.instance.engine.block_manager import BlockId
from services.instance.engine.migration_state import HeldRequest, MigrationBlocks
from services.instance.migration_domain import DestinationPeer, MigrateOutPlan, Reservation
from services.transfer.domain import TransferBackend

if TYPE_CHECKING:
    from services.instance.request_stream import RequestStream
    from services.instance.runner import EngineRunner

_T = TypeVar("_T")


@dataclass(slots=True)
class MigrationInFlight:
    """One migration in flight; owned by its task."""

    migration_id: str
    request_id: str
    plan: MigrateOutPlan
    peer: DestinationPeer
    backend: TransferBackend | None  # None (auto) until the first reservation names the destination's service
    started_at: float = field(default_factory=time.perf_counter)
    reservation: Reservation | None = None
    is_prepare_sent: bool = False  # the destination may hold a reservation (even if the call failed)
    prepared_at: float = 0.0  # the last Prepare's start: the destination's watchdog restarted then
    # Invariant: copied[i] is the source block whose K/V now sit in reservation.block_ids[i];
    # valid only while the request has been preempted num_preemptions times.
    copied: dict[int, BlockId] = field(default_factory=dict)
    num_preemptions: int = 0
    # Leading block-table entries the first Prepare said we no longer hold (behind the sliding window): the
    # destination holds placeholders there, never copied into; the request must not read them at the commit.
    num_not_held_at_destination: int = 0
    dst_checksums: tuple[int, ...] = ()  # crc32 of the destination's cached blocks it still reserves
    checked_preemptions: int | None = None  # the request's num_preemptions when they were checked against ours
    num_cached_rejected: int = 0  # cached blocks the destination gave up for fresh ones: other bits than ours
    num_live_stages: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    suspended_at: float | None = None
    committed_at: float | None = None
    stream: RequestStream | None = None  # the request's client stream when the migration began (an abort drops it)
    held: HeldRequest | None = None  # the plan's parked state, where the request was still parked so when claimed

    @property
    def frontend_attempt(self) -> int:
        """The frontend's attempt at the request that the moving copy belongs to (request_copy); 0: unknown."""
        return self.stream.attempt if self.stream is not None else 0

    def pending(self, view: MigrationBlocks, full_only: bool) -> list[int]:
        """Block-table indexes whose current source block is not copied yet (all once a preemption moved them),
        past the ones the destination had cached with our bits (checked again after a preemption:
        `ReservationKeeper.check_cached`) and those given back out of the sliding window."""
        if view.num_preemptions != self.num_preemptions:
            self.copied.clear()
            self.num_preemptions = view.num_preemptions
        start = self.reservation.num_cached_blocks if self.reservation is not None else 0
        start = max(start, view.num_dropped_blocks, self.num_not_held_at_destination)
        end = view.num_full_blocks if full_only else view.num_blocks
        return [i for i in range(start, end) if self.copied.get(i) != view.block_ids[i]]


async def call_on_copy(runner: EngineRunner, a: MigrationInFlight, fn: Callable[[], _T],
                       is_first: bool = False) -> _T:
    """An engine call on the copy the migration moves, if it still owns its id (Aborted if not); past the
    first, NotFound means it finished."""
    gone = Aborted(f"request {a.request_id} finished or was aborted while migrating to {a.plan.dst_instance_id}; "
                   "nothing left to move")
    if not runner.owns(a.stream):  # (a copy resumed here since is not this migration's)
        raise gone
    try:
        return await runner.call(fn)
    except NotFound:
        if is_first:
            raise
        raise gone from None
