"""A migration's reservation on its destination as the source keeps it: grown and refreshed before each copy,
and cut back to the cached blocks whose bits equal ours; and which transfer backend copies into it."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from services.common.errors import Aborted, FailedPrecondition
from services.instance.engine.block_manager import BlockId
from services.instance.engine.migration_state import MigrationBlocks
from services.instance.migration_attempt import MigrationInFlight, call_on_copy
from services.instance.migration_domain import MigrationSettings, RefusedByDestination, Reservation
from services.transfer.domain import TransferBackend

if TYPE_CHECKING:
    from services.instance.runner import EngineRunner

log = structlog.get_logger(__name__)


class ReservationKeeper:
    """Keeps each migration's reservation on its destination as its copies need it (MigrationDriver)."""

    def __init__(self, runner: EngineRunner, settings: MigrationSettings) -> None:
        self._runner = runner
        self._settings = settings

    def use_settings(self, settings: MigrationSettings) -> None:
        self._settings = settings

    async def reserve(self, a: MigrationInFlight, view: MigrationBlocks, headroom: int) -> None:
        """Make the destination hold at least the request's blocks (+ headroom, within its final size).

        Before every copy: grow if the request outgrew the reservation, and restart the
        destination's watchdog if it could fire before the copy, or the commit after it, ends
        (a reservation must never expire while a copy writes into it or its commit is on the way)."""
        num_reserved = 0 if a.reservation is None else len(a.reservation.block_ids)
        is_fresh = time.perf_counter() - a.prepared_at < self._settings.touch_interval_s
        if a.reservation is not None and num_reserved >= view.num_blocks and is_fresh:
            return
        headroom = headroom if view.num_blocks else 0  # a waiting request moves without blocks
        num_wanted = max(num_reserved, view.num_blocks, min(view.num_blocks + headroom, view.max_num_blocks))
        a.is_prepare_sent = True
        a.prepared_at = time.perf_counter()
        is_first = a.reservation is None
        if is_first:
            a.num_not_held_at_destination = view.num_dropped_blocks
        try:
            a.reservation = await a.peer.prepare_migrate_in(
                a.migration_id, a.request_id, self._settings.instance_id, num_wanted, grow_only=not is_first,
                block_hashes=view.block_hashes if is_first else (),
                timeout_s=a.plan.prepare_timeout_s if is_first else None,
                max_num_tokens=view.max_num_tokens if is_first else 0,
                can_decode_on_prefill=a.plan.can_decode_on_prefill,
                num_leading_blocks_not_held=a.num_not_held_at_destination if is_first else 0)
        except FailedPrecondition as exc:
            if not is_first:
                raise
            raise RefusedByDestination(exc.message, exc.request_id) from exc
        if is_first and a.reservation.num_not_held != a.num_not_held_at_destination:
            raise Aborted(f"request {a.request_id} not migrated, it keeps running on {self._settings.instance_id}: "
                          f"destination {a.plan.dst_instance_id} kept {a.reservation.num_not_held} of the "
                          f"{a.num_not_held_at_destination} entries behind the request's sliding window without a "
                          "block (an older version: it would cache blocks never copied into as the request's "
                          "prefix); upgrade it")
        if a.backend is None:
            a.backend = auto_backend(a.reservation, self._settings.transfer_id, self._settings.offered_backends)
        elif a.backend is TransferBackend.SHM and is_first:
            check_shm_reaches(a.reservation, self._settings.transfer_id, a.plan.dst_instance_id)
        if is_first:
            a.dst_checksums = a.reservation.cached_checksums
            await self.check_cached(a)

    async def check_cached(self, a: MigrationInFlight) -> None:
        """Keep on the destination only the cached blocks whose bits equal this request's blocks here.

        A block's K/V bits depend on how its rows were computed (decoded one by one, within a prompt, a
        prompt cut at another chunk), not only on its tokens, and the request must decode on the bits it
        had here. So the first answer carries the cached blocks' crc32; at the first that differs from
        ours (or past the blocks full here), a grow call with `keep_cached_blocks` swaps that one and the
        rest for fresh blocks, which the stages copy into. Nothing was copied yet into those indexes. An
        older destination sends no checksums: its cached blocks are taken as they are."""
        num_cached = a.reservation.num_cached_blocks
        if not num_cached or not a.dst_checksums:
            return
        engine = self._runner.engine

        def own_full_blocks() -> tuple[int, int, tuple[BlockId, ...]]:
            view = engine.migration_blocks(a.request_id)
            num_own = min(num_cached, view.num_full_blocks)
            num_unread = max(view.num_dropped_blocks, a.num_not_held_at_destination)  # placeholders here or there
            return view.num_preemptions, min(num_unread, num_own), view.block_ids[:num_own]
        a.checked_preemptions, num_dropped, block_ids = await call_on_copy(self._runner, a, own_full_blocks)
        # Off the engine thread (decoding goes on): full blocks are never written again; a preemption meanwhile
        # (its blocks freed) is seen after the pause, which checks them again (_move). Blocks given back out of
        # the window here are not compared: the destination gives them back too, unread.
        own = (0,) * num_dropped + await asyncio.to_thread(engine.block_checksums, block_ids[num_dropped:])
        num_compared = min(len(own), len(a.dst_checksums), num_cached)
        num_kept = next((i for i in range(num_dropped, num_compared) if own[i] != a.dst_checksums[i]), num_compared)
        if num_kept == num_cached:
            return
        a.prepared_at = time.perf_counter()
        a.reservation = await a.peer.prepare_migrate_in(a.migration_id, a.request_id, self._settings.instance_id,
                                                        len(a.reservation.block_ids), grow_only=True,
                                                        keep_cached_blocks=num_kept)
        a.dst_checksums = a.dst_checksums[:num_kept]
        a.num_cached_rejected += num_cached - num_kept
        log.info("migration_cached_blocks_rejected", request_id=a.request_id, dst_instance_id=a.plan.dst_instance_id,
                 migration_id=a.migration_id, num_cached_at_destination=num_kept,
                 cached_blocks_rejected=num_cached - num_kept)


def auto_backend(reservation: Reservation, own_transfer_id: str,
                 offered: tuple[TransferBackend, ...]) -> TransferBackend:
    """SHM when the destination's KV memory is mapped by our own transfer service (one host: a
    direct copy, no socket) and it offers shm; otherwise GRPC (works between any two services),
    unless our service does not offer it: then the first socket backend it does offer."""
    if own_transfer_id and reservation.transfer_id == own_transfer_id and TransferBackend.SHM in offered:
        return TransferBackend.SHM
    if not offered or TransferBackend.GRPC in offered:  # not offered: unknown, grpc is everyone's default
        return TransferBackend.GRPC
    return next((b for b in (TransferBackend.GLOO, TransferBackend.NCCL) if b in offered), TransferBackend.GRPC)


def check_shm_reaches(reservation: Reservation, own_transfer_id: str, dst_instance_id: str) -> None:
    """FAILED_PRECONDITION when shm, named for this migration, cannot reach the destination: shm copies between
    the instances one transfer service maps (one host). Before, the copy failed in our transfer service with its
    raw API's advice ("not mapped ...; call MapInstance on it first"), wrong for an operator who set the manager's
    --migration-backend shm on a fleet of several hosts."""
    if reservation.transfer_id and reservation.transfer_id != own_transfer_id:
        raise FailedPrecondition(
            f"the shm backend copies only between instances whose KV memory one transfer service maps (one host): "
            f"{dst_instance_id}'s is mapped by transfer service {reservation.transfer_id!r}, this instance's by "
            f"{own_transfer_id or 'none'!r}; leave the backend auto (the manager's --migration-backend, this "
            "instance's --transfer-backend): shm within a host, grpc across hosts")
