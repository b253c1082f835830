"""The source side of live migration: move one request, KV cache and all, to another instance.

Design (README "Live migration"); `MigrateOut` reads aloud:

    pick the request  →  reserve blocks on the destination (current length + headroom)
    →  live stages: copy the full blocks not copied yet while the request keeps decoding,
       until few blocks remain (--migration-stage-blocks) or --migration-max-stages ran
    →  suspend it at a step boundary  →  copy the rest, the partial last block included
    →  commit on the destination (state, epoch + 1)  →  hand the client stream off and
       free the blocks here

Downtime is suspend → commit. Until the commit succeeded any failure resumes the request
here and frees the destination's reservation (its watchdog does it if we cannot); after
it the request belongs to the destination, whatever happens here. The migration runs as
a task of its own, so a caller that gives up (deadline, cancel) never leaves it half done.
No transport in here: the destination and the transfer service come in as protocols
(migration_domain.py). Beside it: the pick (migration_pick.py), each migration's state and its
engine calls on the copy it moves (migration_attempt.py), the destination's reservation
(migration_reserve.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import structlog

from services.common.errors import Aborted, FailedPrecondition, FerryError, NotFound, ResourceExhausted
from services.common.pick_announcement import SOURCE_BUSY
from services.common.task_errors import shielded
from services.instance.engine.migration_state import MigrationBlocks, RequestState
from services.instance.handoff import Handoff, RecentHandoffs
from services.instance.migration_attempt import MigrationInFlight, call_on_copy
from services.instance.migration_domain import (BlockTransferer, DestinationPeer, MigrateOutPlan, MigrationResult,
                                                MigrationSettings, RefusedByTransfer)
from services.instance.migration_pick import MigrationPicker
from services.instance.migration_reserve import ReservationKeeper
from services.instance.migration_slots import MigrationSlots
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend

if TYPE_CHECKING:
    from services.instance.engine.engine import LLMEngine
    from services.instance.request_stream import RequestStream
    from services.instance.runner import EngineRunner

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

# Blocks reserved beyond the request's current length, so the final stage rarely has to grow it.
RESERVATION_HEADROOM_BLOCKS = 2


class MigrationDriver:
    def __init__(self, runner: EngineRunner, settings: MigrationSettings, slots: MigrationSlots,
                 peers: Callable[[str], DestinationPeer], transferer: BlockTransferer | None) -> None:
        self._runner = runner
        self._settings = settings
        self._slots = slots
        self._peers = peers  # destination address → its client
        self._transferer = transferer  # None without --transfer-address: migration is off
        self._tasks: set[asyncio.Task[MigrationResult]] = set()
        self._picker = MigrationPicker(runner, settings.instance_id)  # which request; claimed while it moves
        self._reservations = ReservationKeeper(runner, settings)  # each migration's blocks on its destination
        self._drops: set[asyncio.Task[bool]] = set()  # AbortMigrateIn of copies whose hand-off nobody read
        self._handed_off = RecentHandoffs(settings.reservation_timeout_s)
        # Told of each request a failed migration resumed: a state exported while it was parked (for its PD
        # hand-off) is stale from then on.
        self.on_resumed: Callable[[str], None] = lambda request_id: None

    def use_transfer_service(self, transfer_id: str, backends: tuple[TransferBackend, ...]) -> None:
        """The co-located transfer service's id and backends from now on (a new life of it, transfer_link.py):
        `auto_backend` picks shm, or grpc, by them."""
        self._settings = replace(self._settings, transfer_id=transfer_id, offered_backends=backends)
        self._reservations.use_settings(self._settings)

    @property
    def moving(self) -> frozenset[str]:
        """Request ids migrating out now."""
        return frozenset(self._picker.moving)

    def moves(self, copy: RequestStream | None) -> bool:
        """Whether a migration out moves `copy` now: it claimed the id while this copy owned it. Not one that
        claimed it for an older copy (aborted since: a resume of the request here replaced it)."""
        return copy is not None and self._picker.moving.get(copy.request_id) is copy

    @property
    def can_migrate(self) -> bool:
        """Whether this instance has a transfer service (--transfer-address): `migrate_out` refuses every call if not."""
        return self._transferer is not None

    @property
    def has_free_slot(self) -> bool:
        """Whether `migrate_out` may start one now (else it refuses at once: --max-concurrent-migrations)."""
        return self._slots.has_free

    @property
    def num_free_slots(self) -> int:
        """Migration slots `migrate_out` would find free now (LoadReport.num_free_migration_out_slots)."""
        return self._slots.num_free

    async def migrate_out(self, plan: MigrateOutPlan, on_picked: Callable[[str, str], Awaitable[None]] | None = None,
                          copy: RequestStream | None = None) -> MigrationResult:
        """Move one request to `plan`'s destination; raises (and the request stays here) if it cannot.
        `on_picked(request_id, migration_id)` (which must not raise) is awaited once the request is picked:
        MigrateOut tells its caller then, so one whose deadline passes knows which request to look for on the
        destination, and under which migration id (RequestInfo.migration_id) it would hold it.
        `copy`: the copy of `plan.request_id` to move (its stream); Aborted if another copy took its id."""
        if not self.can_migrate:
            raise FailedPrecondition("live migration needs a transfer service: start this instance with "
                                     "--transfer-address <host:port of the co-located transfer service>")
        if plan.dst_instance_id == self._settings.instance_id:
            raise FailedPrecondition(f"the destination {plan.dst_instance_id} is this instance; pick another one")
        migration_id = f"{self._settings.instance_id}-{uuid.uuid4().hex[:12]}"
        try:
            self._slots.acquire(migration_id)
        except ResourceExhausted as exc:  # said apart from the destination's refusal, which has the same words
            raise ResourceExhausted(exc.message, trailing_metadata=SOURCE_BUSY) from exc
        task = asyncio.create_task(self._migrate(migration_id, plan, on_picked, copy), name=f"migrate-{migration_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Given back when the task ends, also one cancelled (close()) before it first ran
        task.add_done_callback(lambda _: self._slots.release(migration_id))
        # A caller cancelled meanwhile (the manager's deadline) stops reading it; _migrate logs its own failure
        return await shielded(task)

    async def close(self) -> None:
        """Cancel migrations in flight (shutdown); each resumes its request here before it ends."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*self._drops, return_exceptions=True)  # each within --migration-rpc-timeout-s

    def drop_unread_handoff(self, request_id: str, handoff: Handoff) -> asyncio.Task[bool]:
        """The client of a request handed off left without reading the hand-off (its stream here ended with
        the hand-off still queued, or its frontend's Abort came here): no frontend knows where to attach, so
        drop the copy on the destination now with AbortMigrateIn, rather than let it decode for no client until
        that instance's watchdog does. The destination refuses it once a client attached. In the background
        (safe from a cancelled coroutine's finally block), within --migration-rpc-timeout-s; True if dropped."""
        self._handed_off.forget(request_id)
        task = asyncio.create_task(self._drop_unread(request_id, handoff), name=f"drop-{handoff.migration_id}")
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)
        return task

    def recent_handoff(self, request_id: str) -> Handoff | None:
        """The hand-off of `request_id` from here, if one was made within --migration-reservation-timeout-s."""
        return self._handed_off.get(request_id)

    async def _drop_unread(self, request_id: str, handoff: Handoff) -> bool:
        was_dropped = await self._quietly(self._peers(handoff.dst_address).abort_migrate_in(handoff.migration_id),
                                          "abort_migrate_in_unread_handoff")
        if was_dropped is None:
            return False
        log.info("migrated_request_unread", request_id=request_id, dst_instance_id=handoff.dst_instance_id,
                 migration_id=handoff.migration_id, was_dropped=was_dropped)
        return was_dropped

    async def _migrate(self, migration_id: str, plan: MigrateOutPlan,
                       on_picked: Callable[[str, str], Awaitable[None]] | None,
                       copy: RequestStream | None) -> MigrationResult:
        # Now claimed: no other migration may suspend it. `stream`: the copy this migration moves, and the only
        # one it acts on (a copy that takes the id meanwhile, a resume of the request here, is left alone).
        request_id, held, stream = await self._picker.pick(plan, copy)
        attempt: MigrationInFlight | None = None
        try:
            attempt = MigrationInFlight(migration_id, request_id, plan, self._peers(plan.dst_address),
                                        plan.backend or self._settings.transfer_backend, stream=stream, held=held)
            if on_picked is not None:
                await on_picked(request_id, migration_id)
            return await self._move(attempt)
        except BaseException as exc:
            if attempt is not None:
                await self._abandon(attempt, exc)
            if isinstance(exc, FerryError):  # the caller may not know which request was picked
                exc.request_id = exc.request_id or request_id
            raise
        finally:
            self._picker.release(request_id)

    async def _move(self, a: MigrationInFlight) -> MigrationResult:
        if a.plan.max_stages == 0:
            return await self._move_in_one_stage(a)
        view = await self._view(a, is_first=True)
        await self._reservations.reserve(a, view, RESERVATION_HEADROOM_BLOCKS)
        view = await self._live_stages(a)
        await self._reservations.reserve(a, view, RESERVATION_HEADROOM_BLOCKS)  # fresh: the paused copy asks nothing
        # suspend_held: a request parked for its PD hand-off meanwhile is ours now (the hand-off was refused: claimed)
        view, state = await self._suspend(a, lambda engine: engine.suspend_held(a.request_id))
        if view.num_preemptions != a.checked_preemptions:  # recomputed since the check: maybe other bits now
            await self._reservations.check_cached(a)
        return await self._copy_rest_and_commit(a, view, state)

    async def _move_in_one_stage(self, a: MigrationInFlight) -> MigrationResult:
        """Suspend (unless the PD hand-off holds it already) and export at once, copy every block, commit."""
        if a.held is not None:
            view, state, a.suspended_at = a.held.blocks, a.held.state, a.held.held_at
        else:
            view, state = await self._suspend(a, lambda engine: engine.suspend_held(a.request_id))
        await self._reservations.reserve(a, view, 0)  # first: the blocks the destination has cached need no copy
        return await self._copy_rest_and_commit(a, view, state)

    async def _copy_rest_and_commit(self, a: MigrationInFlight, view: MigrationBlocks,
                                    state: RequestState) -> MigrationResult:
        """The request is suspended: copy every block still to copy, commit at the destination, hand off."""
        self._check_reads_no_placeholder(a, view)
        await self._copy(a, view, a.pending(view, full_only=False), headroom=0)
        self._check_not_aborted(a)
        await a.peer.commit_migrate_in(a.migration_id, state, attempt=a.frontend_attempt)
        a.committed_at = time.perf_counter()
        await self._hand_off(a, state)
        return self._result(a)

    async def _live_stages(self, a: MigrationInFlight) -> MigrationBlocks:
        """Copy full blocks while the request decodes, until few remain or the stages run out; returns the
        request's blocks as last seen. Each stage copies the blocks as they are when it starts: the first
        those after the first Prepare answered (the blocks filled while it ran go live, not in the pause,
        however slow the destination was), the last view is the one after the last copy."""
        max_stages = self._settings.max_stages if a.plan.max_stages is None else a.plan.max_stages
        view = await self._view(a)
        for _ in range(max_stages):
            full = a.pending(view, full_only=True)
            if not full or len(a.pending(view, full_only=False)) <= self._settings.stage_blocks:
                break
            await self._copy(a, view, full, headroom=RESERVATION_HEADROOM_BLOCKS)
            a.num_live_stages += 1
            view = await self._view(a)
        return view

    def _check_reads_no_placeholder(self, a: MigrationInFlight, view: MigrationBlocks) -> None:
        """The destination reserved no block for the leading entries behind the window when the move began; a
        request recomputed since (a preemption) may read some of them again: it stays here (the destination
        would refuse the commit too)."""
        if view.num_dropped_blocks < a.num_not_held_at_destination:
            raise Aborted(f"request {a.request_id} not migrated, it keeps running on {self._settings.instance_id}: "
                          f"recomputed since its move began, it reads block {view.num_dropped_blocks} again, behind "
                          f"its window then, for which {a.plan.dst_instance_id} reserved none; move it again")

    def _check_not_aborted(self, a: MigrationInFlight) -> None:
        """Before the commit, on the event loop: an abort of the request (its client left) drops its
        stream here at once and frees its blocks on the engine thread soon after, where another request
        may write into them, maybe while they were being copied. So a request whose stream is gone is not
        committed: the destination would take those blocks, and cache them under the request's hashes."""
        if not self._runner.owns(a.stream):
            raise Aborted(f"request {a.request_id} was aborted during its last copy to {a.plan.dst_instance_id}; "
                          "nothing left to move")

    async def _suspend(self, a: MigrationInFlight, suspend: Callable[[LLMEngine], MigrationBlocks]
                       ) -> tuple[MigrationBlocks, RequestState]:
        """Take the request out of the batch at the next step boundary and export its state in the
        same engine call (nothing changes while it is suspended); the downtime starts there."""
        engine = self._runner.engine

        def suspend_and_export() -> tuple[MigrationBlocks, RequestState, float]:
            view = suspend(engine)
            return view, engine.export_state(a.request_id), time.perf_counter()
        # A failure from here on is undone by _abandon, which resumes the request if it is suspended.
        view, state, a.suspended_at = await call_on_copy(self._runner, a, suspend_and_export)
        return view, state

    async def _view(self, a: MigrationInFlight, is_first: bool = False) -> MigrationBlocks:
        return await call_on_copy(self._runner, a, lambda: self._runner.engine.migration_blocks(a.request_id),
                                  is_first)


    async def _copy(self, a: MigrationInFlight, view: MigrationBlocks, indexes: list[int], headroom: int) -> None:
        if not indexes:
            return
        await self._reservations.reserve(a, view, headroom)
        transfer = BlockTransfer(
            src_instance_id=InstanceId(self._settings.instance_id),
            src_block_ids=tuple(view.block_ids[i] for i in indexes),
            dst_instance_id=InstanceId(a.plan.dst_instance_id),
            dst_block_ids=tuple(a.reservation.block_ids[i] for i in indexes),
            dst_transfer_address=a.plan.dst_transfer_address or a.reservation.transfer_address,
            backend=a.backend, is_checksum_verified=self._settings.is_checksum_verified,
            dst_write_grant=a.reservation.write_grant)
        try:
            result = await self._transferer.transfer(transfer, self._settings.transfer_timeout_s, a.request_id)
        except (FailedPrecondition, NotFound) as exc:  # a transfer service refused: a revoked grant, an unmapped cache
            raise Aborted(f"request {a.request_id} not migrated, it keeps running on {self._settings.instance_id}: "
                          f"the copy to {a.plan.dst_instance_id} was refused: {exc.message}") from exc
        except ResourceExhausted as exc:  # staging slots busy: no want of room at the destination
            raise RefusedByTransfer(
                f"request {a.request_id} not migrated, it keeps running on {self._settings.instance_id}: a transfer "
                f"service had no room for the copy to {a.plan.dst_instance_id} (this instance's, or the one at "
                f"{transfer.dst_transfer_address}): {exc.message}", a.request_id) from exc
        a.copied.update((i, view.block_ids[i]) for i in indexes)
        a.num_blocks += result.num_blocks
        a.num_bytes += result.num_bytes

    async def _hand_off(self, a: MigrationInFlight, state: RequestState) -> None:
        """Past the commit: end the client stream with the hand-off and free the blocks here."""
        handoff = Handoff(a.plan.dst_instance_id, a.plan.dst_address, state.epoch, len(state.output_token_ids),
                          a.migration_id, a.frontend_attempt)
        try:
            await self._runner.hand_off(a.request_id, handoff, a.stream)
            self._handed_off.note(a.request_id, handoff)
        except FerryError as exc:  # aborted here between export and release: nobody will attach
            log.info("migrated_request_gone", request_id=a.request_id, reason=exc.message)
            # By migration id, not a plain Abort: the destination drops the copy (it has no client yet)
            # and forgets the migration, which it would otherwise hold until its reservation timeout.
            await self._quietly(a.peer.abort_migrate_in(a.migration_id), "abort_migrate_in_after_commit")

    async def _abandon(self, a: MigrationInFlight, exc: BaseException) -> None:
        """Before the commit: the request runs on here, the destination lets go of what it reserved."""
        if a.committed_at is not None:
            return
        # Resumed if suspended, whoever suspended it: our suspend, or a PD hand-off that parked it meanwhile and
        # left it to us (it is ours: claimed by our pick). False if it was not suspended, or is gone: aborted, maybe
        # resumed here since as another copy, which is not ours to resume (its own PD hand-off may have parked it).
        resumed = await self._runner.resume(a.stream)
        if resumed:
            self.on_resumed(a.request_id)
        if a.is_prepare_sent:
            await self._quietly(a.peer.abort_migrate_in(a.migration_id), "abort_migrate_in")
        log.info("migration_aborted", request_id=a.request_id, dst_instance_id=a.plan.dst_instance_id,
                 migration_id=a.migration_id, resumed=resumed, num_live_stages=a.num_live_stages,
                 reason=getattr(exc, "message", None) or type(exc).__name__)

    async def _quietly(self, call: Awaitable[_T], what: str) -> _T | None:
        """A best-effort clean-up call: its result, or None when it failed (logged; the destination's
        watchdog covers it)."""
        try:
            return await call
        except FerryError as exc:
            log.warning("migration_cleanup_failed", call=what, reason=exc.message)
            return None

    def _result(self, a: MigrationInFlight) -> MigrationResult:
        now = time.perf_counter()
        result = MigrationResult(
            request_id=a.request_id, src_instance_id=self._settings.instance_id,
            dst_instance_id=a.plan.dst_instance_id, num_blocks=a.num_blocks, num_bytes=a.num_bytes,
            num_stages=a.num_live_stages + 1, backend=a.backend,
            duration_ms=(now - min(a.started_at, a.suspended_at)) * 1e3,  # a PD hand-off's request was held first
            downtime_ms=(a.committed_at - a.suspended_at) * 1e3,
            num_cached_at_destination=a.reservation.num_cached_blocks if a.reservation else 0)
        log.info("migration_committed", request_id=a.request_id, dst_instance_id=a.plan.dst_instance_id,
                 num_stages=result.num_stages, num_blocks=result.num_blocks, num_bytes=result.num_bytes,
                 num_cached_at_destination=result.num_cached_at_destination,
                 cached_blocks_rejected=a.num_cached_rejected,
                 backend=a.backend.value, duration_ms=round(result.duration_ms, 2),
                 downtime_ms=round(result.downtime_ms, 2))
        return result
