"""The destination side of live migration: reservations, commits, attaches and their watchdog.

Life of one incoming migration (keyed by the source's migration id):

    PrepareMigrateIn (reserve, grow)  →  CommitMigrateIn (adopt the request; its outputs
    wait in its stream)  →  Attach (a client reads the stream)
    any time before the attach: AbortMigrateIn, or the watchdog once
    --migration-reservation-timeout-s passed without progress; before the commit, also as
    soon as the source leaves etcd's membership (its lease expired: killed, frozen, cut off)
    or comes back as another process.

The reservation's blocks are fenced (write_fence.py): the first Prepare opens a write grant
on this instance's transfer service before any block id leaves, and an uncommitted
reservation's blocks go back to the pool only once the service confirmed the revoke, so a
copy still under way (or frozen and resumed) can never write into blocks given to another
request. Blocks whose revoke is not confirmed stay quarantined; every watchdog sweep asks
again. A commit closes the grant on the next sweep.

A migration holds one of this instance's migration slots from its first Prepare until it
commits or aborts. After the commit the source may still abort it (its commit call failed
on the way back, or its client left without reading the hand-off), until a client attached. The watchdog also drops a committed request
nobody attached to in time, or whose unread outputs pass MAX_UNATTACHED_OUTPUTS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from services.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from services.common.periodic import periodic_loop
from services.common.prefix_hash import BlockHash
from services.common.recent import Recent
from services.common.task_errors import read_error
from services.instance.engine.migration_state import RequestState
from services.instance.migration_domain import Reservation
from services.instance.migration_slots import MigrationSlots
from services.instance.request_copy import CopyRef
from services.instance.request_stream import RequestStream
from services.instance.runner import EngineRunner
from services.instance.write_fence import NoWriteFence, WriteFence

log = structlog.get_logger(__name__)

MAX_UNATTACHED_OUTPUTS = 4096  # outputs a migrated-in request may buffer before a client attaches
MAX_RECENT_ABORTS = 4096  # aborted migrations remembered (for --migration-reservation-timeout-s), to refuse late Prepares

_Reserved = tuple[tuple[int, ...], int]  # the reservation's block ids, and how many lead with cached blocks


@dataclass(slots=True)
class _Incoming:
    migration_id: str
    request_id: str
    src_instance_id: str
    expires_at: float  # monotonic; pushed back by every Prepare and by the commit
    write_grant: int  # opened on this instance's transfer service by the first Prepare
    epoch: int | None = None  # set once committed
    src_process: tuple[Any, Any] | None = None  # the source's (host, pid) in etcd, from the first Prepare that saw it


class Members(Protocol):
    """The instances registered in etcd (a `MembershipView` of "instances")."""

    def get(self, member_id: str) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class TransferEndpoint:
    """The transfer service mapping this instance's KV memory ("" without --transfer-address)."""

    address: str
    transfer_id: str


class MigrationInbox:
    def __init__(self, runner: EngineRunner, slots: MigrationSlots, timeout_s: float,
                 transfer: TransferEndpoint, fence: WriteFence | None = None) -> None:
        self._runner = runner
        self._slots = slots
        self._timeout_s = timeout_s
        self._transfer = transfer
        self._fence = fence or NoWriteFence()
        self._incoming: dict[str, _Incoming] = {}  # by migration id, until attached or aborted
        # Grants to revoke on the next sweep, in order, with the reservation whose blocks to free
        # after (None: committed, the grant is just closed). Uncommitted ones are quarantined blocks.
        self._revoking: dict[int, str | None] = {}
        self._instances: Members | None = None  # set by watch_sources (instances registered in etcd)
        # Migration ids aborted here: a first Prepare that its source's AbortMigrateIn overtook is refused, rather
        # than hold its blocks until the watchdog frees them.
        self._aborted: Recent[str, bool] = Recent(timeout_s, MAX_RECENT_ABORTS)

    def use_transfer(self, transfer: TransferEndpoint) -> None:
        """Name `transfer` in the reservations made from now on (a new life of the service, transfer_link.py)."""
        self._transfer = transfer

    def watch_sources(self, instances: Members) -> None:
        """Free a reservation once its source is gone from `instances`, not only after the timeout."""
        self._instances = instances

    @property
    def num_incoming(self) -> int:
        return len(self._incoming)

    async def prepare(self, migration_id: str, request_id: str, src_instance_id: str,
                      num_blocks: int, grow_only: bool = False, block_hashes: Sequence[BlockHash] = (),
                      keep_cached_blocks: int | None = None, num_leading_blocks_not_held: int = 0) -> Reservation:
        """Reserve (or grow the reservation to) `num_blocks`; ResourceExhausted if short of blocks or slots.
        `grow_only`: the caller holds this reservation already; Aborted if it is gone (expired).
        `block_hashes` (the request's full blocks; first call only): start from the blocks cached here, and
        answer their crc32. `keep_cached_blocks` (a later call): keep only that many of them, fresh blocks
        in the others' places (their bits were not the source's). `num_leading_blocks_not_held` (first call
        only): the leading block-table entries behind the request's sliding window, which the source no longer
        holds: no block is reserved for them (placeholders in the answer, checksum 0)."""
        if not migration_id:
            raise InvalidArgument("migration_id: required")
        if num_blocks < 0:
            raise InvalidArgument(f"num_blocks: must be >= 0, got {num_blocks}")
        if num_leading_blocks_not_held < 0:
            raise InvalidArgument(f"num_leading_blocks_not_held: must be >= 0, got {num_leading_blocks_not_held}")
        if len(block_hashes) > num_blocks:
            raise InvalidArgument(f"block_hashes: {len(block_hashes)} hashes for {num_blocks} blocks; send the hashes "
                                  "of the request's full blocks only")
        incoming = self._incoming.get(migration_id)
        if incoming is not None and incoming.epoch is not None:
            raise FailedPrecondition(f"migration {migration_id} is already committed")
        if incoming is None and not grow_only and self._aborted.get(migration_id):
            raise Aborted(f"migration {migration_id} was aborted here before this first PrepareMigrateIn came (its "
                          "source gave up on it); nothing is reserved")
        if grow_only and incoming is None:
            raise Aborted(f"migration {migration_id}: the reservation here is gone (the watchdog freed it after "
                          f"{self._timeout_s:g} s without a call) or it was aborted; the blocks copied so far are lost")
        is_first = incoming is None
        if is_first and keep_cached_blocks is not None:
            raise InvalidArgument("keep_cached_blocks: only on a later call of the migration (grow_only), after the "
                                  "first answered the cached blocks' checksums")
        if is_first:
            self._slots.acquire(migration_id)
            incoming = _Incoming(migration_id, request_id, src_instance_id, self._deadline(),
                                 self._fence.new_grant_id())
            self._incoming[migration_id] = incoming
        incoming.expires_at = self._deadline()
        incoming.src_process = incoming.src_process or self._process_of(src_instance_id)  # may show up late
        engine = self._runner.engine

        def reserve() -> _Reserved:
            if keep_cached_blocks is not None:
                engine.keep_cached_reserved(migration_id, keep_cached_blocks)
            block_ids = engine.reserve_blocks(migration_id, num_blocks, block_hashes, num_leading_blocks_not_held)
            return block_ids, engine.num_cached_reserved(migration_id)
        try:
            block_ids, num_cached = await (self._reserve_granting(incoming, reserve) if is_first
                                           else self._runner.call(reserve))
        except BaseException:
            if is_first or not await self._runner.call(lambda: migration_id in engine.reservations):
                self._forget(migration_id)  # a first Prepare that failed holds nothing
                await self._runner.call(lambda: engine.free_reservation(migration_id))
            if is_first:  # a grant whose answer was lost may still have opened: close it too
                self._revoking.setdefault(incoming.write_grant, None)
            raise
        # Off the engine thread (decoding goes on): the reservation holds the cached blocks, so nothing writes them.
        num_not_held = min(num_leading_blocks_not_held, num_cached)
        checksums = (0,) * num_not_held + await asyncio.to_thread(engine.block_checksums,
                                                                  block_ids[num_not_held:num_cached]) \
            if is_first else ()
        return Reservation(tuple(block_ids), self._transfer.address, self._transfer.transfer_id, num_cached,
                           incoming.write_grant, checksums, num_leading_blocks_not_held if is_first else 0)

    async def _reserve_granting(self, incoming: _Incoming, reserve: Callable[[], _Reserved]) -> _Reserved:
        """The first Prepare: reserve on the engine while the write grant opens (no block id has left yet)."""
        granting = asyncio.ensure_future(self._fence.grant(incoming.write_grant))
        # Read even when this Prepare is cancelled while it waits for the grant (a PD hand-off's deadline, 1 s,
        # is below the grant's, 2 s): its error was never retrieved, a traceback in the log.
        granting.add_done_callback(read_error)
        try:
            reserved = await self._runner.call(reserve)
        finally:
            await asyncio.wait([granting])
            grant_error = read_error(granting)
        if grant_error is not None:
            raise grant_error  # the transfer service did not take it
        if self._incoming.get(incoming.migration_id) is not incoming:
            # Given up while granting: its blocks went back unfenced, so the ids must never leave.
            await self._fence.revoke(incoming.write_grant)
            raise Aborted(f"migration {incoming.migration_id} was aborted while its reservation was being made")
        return reserved

    async def commit(self, migration_id: str, state: RequestState, deadline: float | None = None,
                     check_accepting: Callable[[], None] = lambda: None, attempt: int = 0) -> None:
        """Adopt the request: it joins the running batch with its K/V in the reserved blocks.

        `check_accepting` raises once the instance takes no more work (SIGTERM); it runs again right before
        the adoption, in the same step as it, since a shutdown that began while this commit awaited would
        count no request here and leave without draining it.

        `deadline` (monotonic): the caller's. A commit taken up after it (this instance was frozen,
        or too slow) is refused and its reservation freed: the source has given up and resumed the
        request, and its abort may never reach us, so adopting it would leave a copy decoding for
        no client."""
        await self._refuse_if_late(migration_id, deadline)
        incoming = self._incoming.get(migration_id)
        if incoming is None:
            raise NotFound(f"migration {migration_id} has no reservation here: it expired "
                           f"(--migration-reservation-timeout-s {self._timeout_s:g}) or was aborted")
        if incoming.epoch is not None:
            raise FailedPrecondition(f"migration {migration_id} is already committed")
        if state.request_id != incoming.request_id:
            raise InvalidArgument(f"state.request_id: {state.request_id} but migration {migration_id} reserved "
                                  f"for {incoming.request_id}")
        incoming.expires_at = self._deadline()
        engine = self._runner.engine
        text = await asyncio.to_thread(engine.restore_text, state)  # replays the detokenizer off the engine thread
        guide = await asyncio.to_thread(engine.new_guide, state.sampling, state.output_token_ids) \
            if state.sampling.grammar else None  # and the grammar's state
        await self._refuse_if_late(migration_id, deadline)
        if not self._is_held(incoming):
            raise _given_up(migration_id)
        check_accepting()
        stream = await self._runner.adopt(
            state.request_id, CopyRef(attempt, state.epoch),
            lambda: engine.import_request(migration_id, state, text, guide, incoming.src_instance_id))
        if not self._is_held(incoming) or self._runner.stream(state.request_id) is not stream:
            # Given up (aborted, or the watchdog) while the import waited for the engine: nothing tracks the
            # adopted request any more, so no watchdog would ever drop it; or its copy was dropped meanwhile (a
            # resume of the request here took its place: `drop_unattached`). The source keeps the request.
            if self._runner.stream(state.request_id) is stream:
                await self._runner.abort(state.request_id)
            await self.abort(migration_id)  # if still held: forget it and close its grant (the copy took its blocks)
            raise _given_up(migration_id)
        incoming.epoch = state.epoch
        incoming.expires_at = self._deadline()  # now the deadline to attach
        self._slots.release(migration_id)
        self._revoking[incoming.write_grant] = None  # every block is in: close the grant (next sweep)
        log.info("migration_in_committed", request_id=state.request_id, migration_id=migration_id,
                 src_instance_id=incoming.src_instance_id, epoch=state.epoch,
                 num_computed_tokens=state.num_computed_tokens)

    def _is_held(self, incoming: _Incoming) -> bool:
        """Not given up (aborted, expired) since `incoming` was looked up."""
        return self._incoming.get(incoming.migration_id) is incoming

    async def _refuse_if_late(self, migration_id: str, deadline: float | None) -> None:
        if deadline is None or time.monotonic() < deadline:
            return
        await self.abort(migration_id)
        log.warning("migration_in_commit_too_late", migration_id=migration_id,
                    late_s=round(time.monotonic() - deadline, 3),
                    action="refused: its source gave up on it and keeps the request (if late_s is far above "
                           "the source's --migration-rpc-timeout-s, check that the hosts' clocks agree)")
        raise Aborted(f"the commit of migration {migration_id} was taken up after its caller's deadline; the source "
                      "keeps the request and nothing was adopted here")

    async def abort(self, migration_id: str) -> bool:
        """Free the reservation, or drop the committed request nobody attached to; False if neither. A first
        Prepare of the migration that comes after this is refused."""
        self._aborted.note(migration_id, True)
        incoming = self._incoming.get(migration_id)
        if incoming is None:
            return False
        if incoming.epoch is None:
            self._forget(migration_id)  # from here on only _free_fenced knows the blocks: it must finish
            freeing = asyncio.ensure_future(self._free_fenced(incoming))
            freeing.add_done_callback(_log_failure)  # seen even when our caller was cancelled meanwhile
            return await asyncio.shield(freeing)
        stream = self._runner.stream(incoming.request_id)
        self._forget(migration_id)
        if stream is None or stream.is_attached or stream.epoch != incoming.epoch:
            return False  # finished, attached or replaced meanwhile: not ours to drop
        await self._runner.abort(incoming.request_id)
        return True

    async def drop_unattached(self, request_id: str) -> str:
        """Drop a request that migrated in but that no client attached to; the id of the migration that
        committed the dropped copy, "" if there is none (a copy a commit is still admitting is dropped too,
        and that commit then fails: no id).

        Its source can die between the commit and the hand-off reaching the client: the client
        then resumes the request with Generate, maybe here, and the resume takes its place (and the id:
        the manager asking about that migration learns it committed, RequestInfo.migration_id)."""
        committed = [i for i in self._incoming.values() if i.request_id == request_id and i.epoch is not None]
        replaced = [incoming.migration_id for incoming in committed if await self.abort(incoming.migration_id)]
        is_admitting_dropped = await self._drop_admitting(request_id)
        if replaced or is_admitting_dropped:
            log.warning("migration_in_replaced_by_resume", request_id=request_id,
                        migration_id=replaced[-1] if replaced else "")
        return replaced[-1] if replaced else ""

    async def _drop_admitting(self, request_id: str) -> bool:
        """Drop the copy of `request_id` that a commit is admitting here now (its stream is open, and only
        streams of requests that migrated in wait for a client); that commit then fails (`commit`)."""
        stream = self._runner.stream(request_id)
        if stream is None or stream.is_attached:
            return False
        await self._runner.abort(request_id)  # after the import on the engine thread: commands run in order
        return True

    def attach(self, request_id: str, epoch: int, from_token_index: int = 0) -> RequestStream:
        """The stream of a request that migrated in, for the client following its hand-off."""
        stream = self._runner.stream(request_id)
        if stream is None:
            raise NotFound(f"request {request_id} is not on this instance (finished, aborted, or never migrated here)")
        if stream.epoch != epoch:
            raise Aborted(f"request {request_id} is at epoch {stream.epoch} here, not {epoch}; "
                          "follow the latest hand-off")
        if stream.is_attached:
            raise FailedPrecondition(f"request {request_id} already has a client attached")
        self._runner.attach(stream, from_token_index)
        self.forget_committed(request_id)
        return stream

    def forget_committed(self, request_id: str) -> None:
        """Forget the committed migration of `request_id` here (its client attached, or aborted it): nothing is
        left for the watchdog to drop. Only the committed one: an earlier attempt's reservation whose abort was
        lost is the watchdog's to free."""
        for incoming in [i for i in self._incoming.values() if i.request_id == request_id and i.epoch is not None]:
            self._forget(incoming.migration_id)

    async def watchdog_loop(self) -> None:
        """Free reservations whose source went quiet and migrated-in requests nobody attached to."""
        await periodic_loop("migration_watchdog_loop", min(1.0, self._timeout_s / 4),
                            lambda: self.expire(time.monotonic()))

    async def expire(self, now: float) -> None:
        await self._retry_revokes()
        for incoming in list(self._incoming.values()):
            if (reason := self._expiry_reason(incoming, now)) is not None:
                was_dropped = await self.abort(incoming.migration_id)
                log.warning("migration_in_expired", migration_id=incoming.migration_id, reason=reason,
                            request_id=incoming.request_id, src_instance_id=incoming.src_instance_id,
                            is_committed=incoming.epoch is not None, was_dropped=was_dropped)

    @property
    def num_quarantined(self) -> int:
        """Uncommitted reservations whose blocks wait for a confirmed revoke."""
        return sum(migration_id is not None for migration_id in self._revoking.values())

    def _expiry_reason(self, incoming: _Incoming, now: float) -> str | None:
        if incoming.expires_at <= now:
            return "timeout"
        if self._is_overflowing(incoming):
            return "unread_outputs"
        if self._is_source_gone(incoming):
            return "source_gone"
        return None

    async def _free_fenced(self, incoming: _Incoming) -> bool:
        """Free an uncommitted reservation's blocks once no copy can write into them any more; until the
        transfer service confirms that, they stay quarantined (the next sweeps ask again). While earlier
        ones wait, it is not asked again here: one unanswered call a sweep, not one per reservation."""
        if not self.num_quarantined and await self._fence.revoke(incoming.write_grant):
            return await self._free_blocks(incoming.migration_id)
        self._revoking[incoming.write_grant] = incoming.migration_id
        log.warning("migration_in_blocks_quarantined", migration_id=incoming.migration_id,
                    request_id=incoming.request_id, write_grant=incoming.write_grant)
        return True

    async def _retry_revokes(self) -> None:
        for grant_id, migration_id in list(self._revoking.items()):
            if not await self._fence.revoke(grant_id):
                return  # the transfer service still does not answer: the next sweep
            del self._revoking[grant_id]
            if migration_id is not None:
                await self._free_blocks(migration_id)
                log.info("migration_in_blocks_released", migration_id=migration_id, write_grant=grant_id)

    async def _free_blocks(self, migration_id: str) -> bool:
        return await self._runner.call(lambda: self._runner.engine.free_reservation(migration_id))

    def _is_overflowing(self, incoming: _Incoming) -> bool:
        stream = self._runner.stream(incoming.request_id) if incoming.epoch is not None else None
        return stream is not None and not stream.is_attached and stream.outputs.qsize() > MAX_UNATTACHED_OUTPUTS

    def _is_source_gone(self, incoming: _Incoming) -> bool:
        """Before the commit only: a committed request waits for its client, whom the source may have
        handed it to just before it went (a drained instance that was stopped at once)."""
        if incoming.epoch is not None or incoming.src_process is None:
            return False  # committed, or a source etcd never showed us: the timeout decides
        return self._process_of(incoming.src_instance_id) != incoming.src_process

    def _process_of(self, instance_id: str) -> tuple[Any, Any] | None:
        record = self._instances.get(instance_id) if self._instances is not None else None
        return None if record is None else (record.get("host"), record.get("pid"))

    def _forget(self, migration_id: str) -> None:
        self._incoming.pop(migration_id, None)
        self._slots.release(migration_id)

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s


def _given_up(migration_id: str) -> Aborted:
    return Aborted(f"migration {migration_id} was given up here while its commit was under way (aborted, its "
                   "source left etcd, or a resume of the request here took its place); the source keeps the request")


def _log_failure(task: asyncio.Future) -> None:
    if (error := read_error(task)) is not None:
        log.error("migration_in_free_failed", exc_info=error)
