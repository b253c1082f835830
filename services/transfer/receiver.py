"""The destination side: take a block stream (grpc pieces or channel messages) and scatter it.

Receiving chunk i+1 into one staging buffer overlaps scattering chunk i from the other
(`ScatterBehind`, on the one copy thread, so chunks land in order and checksums chain);
on a gloo channel, receives for the following chunks are posted into the slot's other
buffers meanwhile, so the sender's chunks in flight spread over its connections.
grpc: a message that carries a whole chunk (what ferry senders send) is scattered
straight from the received bytes, with no staging copy; smaller pieces are assembled in
the staging buffer. gloo: the rows of an in-place span whose destination ids are
consecutive are received right where they belong, from one io thread (in batches, whose
views it makes too: see `segments`), and only checked.
A checksum mismatch raises Aborted; a short or overlong stream raises InvalidArgument.
Scattered blocks of a failed stream are garbage, but the failure is what the sender
reports: nothing partially applied is ever called a success.
Every write into the KV holds the transfer's write grant (write_grants.py), checked before
each chunk. A refused channel transfer (a closed grant, a checksum, a header this side cannot
take) whose rest is small is taken into scratch memory, so the channel, which every transfer
between the two services shares, stays usable; otherwise, or once a receive failed, the
channel is dropped. A refused grpc stream with a small rest is read to its end before the
answer, since grpc's asyncio client loses the status of a call that ends while it writes.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from services.common.error_text import typed_error_text
from services.common.errors import FerryError, InvalidArgument, ResourceExhausted
from services.common.task_errors import read_error
from services.instance.engine.kv_cache import KvGeometry
from services.transfer.block_copy import as_bytes, in_place_view, scatter_chunk, segments, staged_view
from services.transfer.channels import ChannelTable
from services.transfer.checksum import ChecksumVerifier
from services.transfer.chunk_plan import Chunk, ChunkPlan, check_block_ids, check_compatible
from services.transfer.deadline import Deadline
from services.transfer.domain import IncomingBlocks, TransferBackend
from services.transfer.kv_mappings import KvMappings
from services.transfer.metrics import IN_PLACE_BYTES
from services.transfer.pair_channel import PairChannel, chunk_tag, move_in_place
from services.transfer.pipeline import ScatterBehind
from services.transfer.staging import StagingPool, StagingSlot
from services.transfer.threads import TransferThreads, run_in_thread, wait_for_threads
from services.transfer.write_grants import WriteGrant

log = structlog.get_logger(__name__)

# A refused channel transfer with at most this much left is taken and discarded, keeping the channel
# for the other transfers on it (tens of ms at gloo's speeds); a bigger rest drops the channel instead,
# so that its sender hears the refusal at once rather than after sending it all.
MAX_DISCARD_BYTES = 64 << 20
MAX_DISCARD_S = 5.0  # for the rest of a refused grpc stream (tens of ms at grpc's speeds)
DISCARD_SLOT_WAIT_S = 1.0  # for a staging buffer to discard into; then the channel is dropped instead


@dataclass(frozen=True, slots=True)
class Destination:
    """The validated destination side of one incoming transfer."""

    rows: torch.Tensor  # [layers * 2, blocks, row_elems] of the destination instance's KV
    block_ids: tuple[int, ...]
    plan: ChunkPlan
    verifier: ChecksumVerifier  # folds in every chunk, staged or received in place
    grant: WriteGrant  # held while writing; checked before each chunk


@dataclass(slots=True)
class _Progress:
    """How far a channel transfer got: chunks before `next_chunk` are off the channel; `is_clean` until a
    receive failed (then messages may be left half-read on it, and only dropping it is safe)."""

    next_chunk: int = 0
    is_clean: bool = True

    def took(self, posted: deque[tuple[Chunk, torch.Tensor, asyncio.Future]]) -> None:
        """Count the receives that were posted in chunk order and have all ended (reading every error)."""
        for chunk, _buffer, future in posted:
            failed = future.cancelled() or read_error(future) is not None
            self.is_clean = self.is_clean and not failed
            if self.is_clean:
                self.next_chunk = chunk.index + 1


class BlockReceiver:
    def __init__(self, mappings: KvMappings, staging: StagingPool, channels: ChannelTable,
                 threads: TransferThreads, nccl_staging: StagingPool | None = None) -> None:
        self._mappings = mappings
        self._staging = staging
        self._nccl_staging = nccl_staging or staging  # on the nccl device: chunks arrive with no bounce copy
        self._channels = channels
        self._threads = threads

    async def receive_pieces(self, header: IncomingBlocks, pieces: AsyncIterator[memoryview], timeout_s: float) -> int:
        """grpc: each chunk from byte pieces (a piece never spans two chunks)."""
        deadline = Deadline.after(timeout_s)
        counted = CountedPieces(pieces)
        try:
            plan = await self._receive_pieces(header, counted, deadline)
        except FerryError:
            # grpc's client loses our status if the call ends while it still writes (grpc/grpc#36066):
            # take a small rest, so that the sender hears why.
            await discard_pieces(counted, _stream_bytes(header) - counted.num_bytes, deadline)
            raise
        log.info("blocks_received", dst_instance_id=header.dst_instance_id, num_blocks=len(header.dst_block_ids),
                 num_bytes=plan.num_bytes, backend=TransferBackend.GRPC.value)
        return plan.num_bytes

    async def _receive_pieces(self, header: IncomingBlocks, pieces: AsyncIterator[memoryview],
                              deadline: Deadline) -> ChunkPlan:
        async with self._mappings.write_grants.writing(header.dst_instance_id, header.write_grant) as grant:
            grant.check()
            target = self._target(header, grant)
            plan = target.plan
            async with self._staging.slot(deadline.remaining_s()) as slot:
                scatterer = self._scatter_behind(target, slot)
                try:
                    for chunk in plan.chunks():
                        buffer = await scatterer.buffer_for(chunk)
                        staged = await _receive_chunk(buffer, plan.chunk_bytes(chunk), pieces, chunk)
                        scatterer.submit(chunk, staged_view(staged, plan, chunk, target.rows.dtype))
                    await _expect_end(pieces)
                    await scatterer.finish()
                finally:
                    await scatterer.close()
        return plan

    async def receive_on_channel(self, header: IncomingBlocks, backend: TransferBackend, tag: int,
                                 timeout_s: float, channel_id: int = 0) -> int:
        """gloo/nccl: one message per chunk on the channel the sender opened (`channel_id`; 0: its current one)."""
        deadline = Deadline.after(timeout_s)
        channel = self._channels.incoming(header.src_transfer_id, backend, channel_id)
        with channel.in_use():
            return await self._receive_on(channel, header, backend, tag, deadline)

    async def _receive_on(self, channel: PairChannel, header: IncomingBlocks, backend: TransferBackend, tag: int,
                          deadline: Deadline) -> int:
        staging = self._nccl_staging if backend is TransferBackend.NCCL else self._staging
        progress = _Progress()
        refusal: FerryError | None = None
        # The grant is held until the channel is dropped too: an in-place receive posted on it writes into the KV.
        async with self._mappings.write_grants.writing(header.dst_instance_id, header.write_grant) as grant:
            try:
                grant.check()
                target = self._target(header, grant)
                await self._receive_all(channel, target, staging, tag, deadline, progress)
            except BaseException as exc:
                if not (isinstance(exc, FerryError) and progress.is_clean):
                    # Destroying our end of the group closes its connection, so a sender blocked in
                    # send (it waits for a matching recv) fails at once instead of at its deadline.
                    self._channels.drop_incoming(header.src_transfer_id, backend, only=channel)
                    raise
                refusal = exc
        if refusal is not None:
            # A refusal (a closed grant, a checksum, a header this side cannot take) with nothing left
            # half-read: take the rest of the sender's messages into scratch memory (no grant needed) and
            # keep the channel, which other transfers share.
            try:
                if not await self._discard_rest(channel, header, staging, tag, deadline, progress.next_chunk):
                    self._channels.drop_incoming(header.src_transfer_id, backend, only=channel)
                raise refusal
            finally:
                refusal = None  # no exception -> traceback -> frame -> exception cycle
        log.info("blocks_received", dst_instance_id=header.dst_instance_id, num_blocks=len(header.dst_block_ids),
                 num_bytes=target.plan.num_bytes, backend=backend.value)
        return target.plan.num_bytes

    async def _receive_all(self, channel: PairChannel, target: Destination, staging: StagingPool, tag: int,
                           deadline: Deadline, progress: _Progress) -> None:
        async with staging.slot(deadline.remaining_s()) as slot:
            scatterer = self._scatter_behind(target, slot)
            try:
                await self._receive_chunks(channel, target, slot, scatterer, tag, deadline, progress)
                await scatterer.finish()
            finally:
                await scatterer.close()

    async def _receive_chunks(self, channel: PairChannel, target: Destination, slot: StagingSlot,
                              scatterer: ScatterBehind, tag: int, deadline: Deadline, progress: _Progress) -> None:
        """Staged chunks through the buffers; in-place spans (gloo) straight into the KV memory."""
        for chunks, in_place in segments(target.plan, target.rows, target.block_ids, channel.moves_in_place):
            if not in_place:
                await self._receive_staged(channel, target, chunks, slot, scatterer, tag, deadline, progress)
                continue
            # The staged chunks before are all in (tags repeat every TAG_STRIDE chunks).
            target.grant.check()
            try:
                await run_in_thread(self._threads.io, move_in_place, channel.recv_in_order, target.rows,
                                    target.block_ids, chunks, tag, deadline.remaining_s())
            except BaseException:
                progress.is_clean = False  # some of the span may still be on the channel
                raise
            progress.next_chunk = chunks[-1].index + 1
            IN_PLACE_BYTES.labels("received").inc(sum(map(target.plan.chunk_bytes, chunks)))
            if target.verifier.is_enabled:  # on the copy thread, after the scatters before it
                await run_in_thread(self._threads.copy, _verify_in_place, target, chunks)

    async def _receive_staged(self, channel: PairChannel, target: Destination, chunks: Iterable[Chunk],
                              slot: StagingSlot, scatterer: ScatterBehind, tag: int, deadline: Deadline,
                              progress: _Progress) -> None:
        """Keep receives posted for the next chunks (all buffers but the one being scattered;
        one on a serial channel) and scatter each chunk as it lands, in order."""
        window = 1 if channel.is_serial else len(slot.buffers) - 1
        pending = iter(chunks)
        posted: deque[tuple[Chunk, torch.Tensor, asyncio.Future]] = deque()

        async def post(chunk: Chunk) -> None:
            buffer = (await scatterer.buffer_for(chunk))[:target.plan.chunk_bytes(chunk)]
            future = asyncio.get_running_loop().run_in_executor(
                self._threads.io, channel.recv, buffer, chunk_tag(tag, chunk.index), deadline.remaining_s())
            posted.append((chunk, buffer, future))
        try:
            for chunk in itertools.islice(pending, window):
                await post(chunk)
            while posted:
                chunk, buffer, received = posted[0]
                await asyncio.shield(received)
                posted.popleft()
                progress.next_chunk = chunk.index + 1
                scatterer.submit(chunk, staged_view(buffer, target.plan, chunk, target.rows.dtype))
                if (following := next(pending, None)) is not None:
                    await post(following)
        finally:
            # They write into the slot's buffers: wait before it is released (also if cancelled meanwhile).
            await wait_for_threads(future for _chunk, _buffer, future in posted)
            progress.took(posted)

    async def _discard_rest(self, channel: PairChannel, header: IncomingBlocks, staging: StagingPool, tag: int,
                            deadline: Deadline, next_chunk: int) -> bool:
        """Receive the sender's messages from chunk `next_chunk` on into a scratch buffer and drop them,
        one at a time in order (each takes one the sender has in flight). False if that failed: the
        caller then drops the channel."""
        try:
            plan = _header_plan(header, header.geometry)  # how the sender sends
            rest = await run_in_thread(self._threads.copy, _small_rest, plan, next_chunk)  # 64k chunks: ~0.3 s
            if rest is None:
                return False  # taking it all would hold the sender longer than dropping costs the others
            async with staging.slot(min(deadline.remaining_s(), DISCARD_SLOT_WAIT_S)) as slot:
                scratch = slot.buffers[0]
                for chunk in rest:
                    num_bytes = plan.chunk_bytes(chunk)
                    if num_bytes > scratch.numel():
                        return False
                    await run_in_thread(self._threads.io, channel.recv, scratch[:num_bytes],
                                        chunk_tag(tag, chunk.index), deadline.remaining_s())
        except Exception as exc:  # noqa: BLE001 - any failure here means the channel is not clean
            log.info("refused_blocks_not_drained", src_transfer_id=header.src_transfer_id, reason=typed_error_text(exc)[:200])
            return False
        return True

    def _target(self, header: IncomingBlocks, grant: WriteGrant) -> Destination:
        rows, geometry = self._mappings.rows(header.dst_instance_id)
        check_compatible(header.geometry, geometry)
        check_block_ids(header.dst_block_ids, geometry.num_blocks, "dst_block_ids", is_unique=True)
        plan = _header_plan(header, geometry)
        if plan.max_chunk_bytes > self._staging.buffer_bytes:
            raise ResourceExhausted(f"chunks of {plan.max_chunk_bytes} bytes do not fit this service's staging "
                                    f"buffers of {self._staging.buffer_bytes} bytes; give both transfer services the "
                                    "same --staging-kib")
        return Destination(rows, header.dst_block_ids, plan, ChecksumVerifier(plan, header.checksums), grant)

    def _scatter_behind(self, target: Destination, slot: StagingSlot) -> ScatterBehind:
        def verify_and_scatter(chunk: Chunk, staged: torch.Tensor) -> None:
            target.grant.check()
            target.verifier.update(chunk, staged)
            scatter_chunk(target.rows, target.block_ids, chunk, staged)
        return ScatterBehind(slot, verify_and_scatter, self._threads.copy)


def _header_plan(header: IncomingBlocks, geometry: KvGeometry) -> ChunkPlan:
    """The chunks the header's sender cuts the transfer into, over `geometry`."""
    return ChunkPlan.from_header(geometry, len(header.dst_block_ids), header.blocks_per_chunk, header.rows_per_chunk,
                                 header.in_place_spans)


def _small_rest(plan: ChunkPlan, next_chunk: int) -> list[Chunk] | None:
    """The plan's chunks from `next_chunk` on, or None if they carry more than MAX_DISCARD_BYTES (counted
    first, none kept: 200k chunks alive at once set off a full garbage collection, which stops every
    thread ~0.2 s)."""
    num_bytes = 0
    for chunk in itertools.islice(plan.chunks(), next_chunk, None):
        num_bytes += plan.chunk_bytes(chunk)
        if num_bytes > MAX_DISCARD_BYTES:
            return None
    return list(itertools.islice(plan.chunks(), next_chunk, None))


def _verify_in_place(target: Destination, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        target.verifier.update(chunk, in_place_view(target.rows, target.block_ids, chunk))


async def _receive_chunk(buffer: torch.Tensor, num_bytes: int, pieces: AsyncIterator[memoryview],
                         chunk: Chunk) -> torch.Tensor:
    """The chunk's bytes (flat uint8): the first piece itself if it holds the whole chunk, else
    the pieces copied into `buffer`."""
    piece = await _next_piece(pieces, chunk, 0, num_bytes)
    if len(piece) == num_bytes:
        with warnings.catch_warnings():  # read-only memory: scatters and checksums only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(piece, dtype=torch.uint8)
    await _fill(buffer, num_bytes, piece, pieces, chunk)
    return buffer


async def _next_piece(pieces: AsyncIterator[memoryview], chunk: Chunk, filled: int, num_bytes: int) -> memoryview:
    try:
        return await anext(pieces)
    except StopAsyncIteration:
        raise InvalidArgument(f"block stream ended in chunk {chunk.index} after {filled} of {num_bytes} "
                              "bytes; the sender stopped early") from None


async def _fill(buffer: torch.Tensor, num_bytes: int, piece: memoryview, pieces: AsyncIterator[memoryview],
                chunk: Chunk) -> None:
    target = as_bytes(buffer[:num_bytes].view(1, 1, -1)).reshape(-1)
    filled = 0
    while True:
        if filled + len(piece) > num_bytes:
            raise InvalidArgument(f"block stream piece of {len(piece)} bytes overruns chunk {chunk.index} "
                                  f"({num_bytes - filled} bytes left); pieces must not span chunks")
        target[filled:filled + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        filled += len(piece)
        if filled == num_bytes:
            return
        piece = await _next_piece(pieces, chunk, filled, num_bytes)


async def _expect_end(pieces: AsyncIterator[bytes]) -> None:
    async for piece in pieces:
        raise InvalidArgument(f"block stream has {len(piece)}+ bytes after the last block; "
                              "sender and receiver disagree on the geometry")


class CountedPieces:
    """The pieces of a grpc block stream, counting the bytes taken off it."""

    def __init__(self, pieces: AsyncIterator[memoryview]) -> None:
        self._pieces = pieces
        self.num_bytes = 0

    def __aiter__(self) -> CountedPieces:
        return self

    async def __anext__(self) -> memoryview:
        piece = await anext(self._pieces)
        self.num_bytes += len(piece)
        return piece


def _stream_bytes(header: IncomingBlocks) -> int:
    """What the header says its stream carries."""
    return len(header.dst_block_ids) * header.geometry.bytes_per_block


async def discard_pieces(pieces: CountedPieces, rest_bytes: int, deadline: Deadline) -> None:
    """Read the rest of a refused grpc stream and drop it, if it is at most MAX_DISCARD_BYTES (a bigger rest
    would hold the sender longer than its fallback question costs); stop early past that, at the deadline,
    or after MAX_DISCARD_S (a stalled sender must not hold the call)."""
    if rest_bytes > MAX_DISCARD_BYTES:
        return
    limit = pieces.num_bytes + MAX_DISCARD_BYTES
    try:
        async with asyncio.timeout(min(deadline.remaining_s(), MAX_DISCARD_S)):
            async for _piece in pieces:
                if pieces.num_bytes > limit:
                    return
    except Exception:  # noqa: BLE001 - best effort: the refusal is what the caller raises
        return
