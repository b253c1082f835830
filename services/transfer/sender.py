"""The source side of Transfer: validate, then move the blocks with the requested backend.

* SHM: both instances are mapped here; one direct copy, no staging (torch's intra-op
  threads share it), on the copy thread, or right on the event loop when it is small
  (`INLINE_COPY_MAX_BYTES`) and unchecked.
* GRPC: one ReceiveBlocks message per chunk (chunks no bigger than the peer link's
  piece size); the next message is built on the copy thread while the current one is
  sent, gathered straight from the KV memory into the message bytes (one copy; a CUDA
  source goes through the slot's staging buffers).
* GLOO / NCCL: open (once) the pair channel to the peer, ask it to ExpectBlocks, and
  send each gathered chunk on the channel while it receives and scatters. NCCL chunks are
  gathered into staging buffers on the channel's GPU where the service has them (a cache
  on a GPU then never goes through host memory). Several
  chunks are in flight at once (one per staging buffer; one at a time on nccl), each
  with its own tag, so they spread over the gloo connections. On gloo, runs of
  consecutive blocks (`find_in_place_spans`) travel row by row, sent straight from the
  KV memory where the source's ids are consecutive and received straight into it where
  the destination's are. The event loop hands those rows to an io thread in batches
  (`segments`), which makes their views and posts them: a transfer of 64k small rows had
  them all made on the loop, which it held for seconds.

Nothing is reported as success unless every block reached the destination (and, with
checksums, matched); any failure raises and a broken channel is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import structlog
import torch

from services.common.errors import Aborted, FailedPrecondition, FerryError, InvalidArgument, NotFound, ResourceExhausted
from services.common.task_errors import read_error
from services.transfer.block_copy import as_bytes, chunk_parts, copy_blocks, gather_chunk, segments, staged_view
from services.transfer.channels import ChannelTable
from services.transfer.checksum import block_checksums
from services.transfer.chunk_plan import (IN_PLACE_MIN_ROW_BYTES, Chunk, ChunkPlan, check_block_ids, check_compatible,
                                          find_in_place_spans)
from services.transfer.convert import encode_data_message
from services.transfer.deadline import Deadline
from services.transfer.domain import BlockTransfer, IncomingBlocks, TransferBackend, TransferId, TransferResult
from services.transfer.kv_mappings import KvMappings
from services.transfer.metrics import IN_PLACE_BYTES
from services.transfer.pair_channel import TAG_STRIDE, PairChannel, chunk_tag, move_in_place
from services.transfer.peer import PeerFactory
from services.transfer.pipeline import BufferRing, GatherAhead
from services.transfer.staging import StagingPool, StagingSlot
from services.transfer.threads import TransferThreads, run_in_thread

log = structlog.get_logger(__name__)

# A same-host copy this small takes well under a millisecond: it runs right on the event loop,
# since the hop to the copy thread and back measured 0.3 ms, as long as the copy of 8 MiB.
INLINE_COPY_MAX_BYTES = 8 << 20
PEER_ANSWER_GRACE_S = 1.0  # after our send broke, how long to wait for the peer to say why
# What a receiver answers when it refused blocks but took every message (services/transfer/receiver.py).
CLEAN_REFUSALS = (FailedPrecondition, Aborted, NotFound, InvalidArgument, ResourceExhausted)


@dataclass(frozen=True, slots=True)
class SourceBlocks:
    """The validated source side of one transfer."""

    rows: torch.Tensor  # [layers * 2, blocks, row_elems]
    block_ids: tuple[int, ...]
    index: torch.Tensor  # block_ids as int64, for index_select
    plan: ChunkPlan
    header: IncomingBlocks


class BlockSender:
    def __init__(self, transfer_id: TransferId, backends: tuple[TransferBackend, ...], mappings: KvMappings,
                 staging: StagingPool, channels: ChannelTable, peers: PeerFactory, threads: TransferThreads,
                 in_place_min_row_bytes: int = IN_PLACE_MIN_ROW_BYTES, nccl_staging: StagingPool | None = None) -> None:
        self._transfer_id = transfer_id
        self._backends = backends
        self._mappings = mappings
        self._staging = staging
        self._nccl_staging = nccl_staging or staging  # on the nccl device: chunks go to NCCL with no bounce copy
        self._channels = channels
        self._peers = peers
        self._threads = threads
        self._tags = itertools.count(1)
        self._in_place_min_row_bytes = in_place_min_row_bytes  # 0: no in-place spans

    async def transfer(self, request: BlockTransfer, timeout_s: float) -> TransferResult:
        if request.backend not in self._backends:
            raise FailedPrecondition(f"backend {request.backend.value} is not offered by transfer service "
                                     f"{self._transfer_id!r}; start it with --backends including it")
        deadline = Deadline.after(timeout_s)
        started = time.perf_counter()
        if request.backend is TransferBackend.SHM:
            num_bytes = await self._copy_local(request)
        else:
            num_bytes = await self._send(request, deadline)
        result = TransferResult(request.num_blocks, num_bytes, (time.perf_counter() - started) * 1e3, request.backend)
        log.info("blocks_transferred", src_instance_id=request.src_instance_id, dst_instance_id=request.dst_instance_id,
                 num_blocks=result.num_blocks, num_bytes=num_bytes, backend=request.backend.value,
                 duration_ms=round(result.duration_ms, 2))
        return result

    # -- SHM ---------------------------------------------------------------------------

    async def _copy_local(self, request: BlockTransfer) -> int:
        src_rows, src_geometry = self._mappings.rows(request.src_instance_id)
        dst_rows, dst_geometry = self._mappings.rows(request.dst_instance_id)
        check_compatible(src_geometry, dst_geometry)
        check_block_ids(request.src_block_ids, src_geometry.num_blocks, "src_block_ids", is_unique=False)
        check_block_ids(request.dst_block_ids, dst_geometry.num_blocks, "dst_block_ids", is_unique=True)
        if request.src_instance_id == request.dst_instance_id and set(request.src_block_ids) & set(request.dst_block_ids):
            raise InvalidArgument("dst_block_ids: a copy within one instance must not write blocks it reads "
                                  "(runs are copied in place, so a block could be read after it was written)")
        num_bytes = request.num_blocks * src_geometry.bytes_per_block
        copy = (src_rows, request.src_block_ids, dst_rows, request.dst_block_ids, request.is_checksum_verified)
        async with self._mappings.write_grants.writing(request.dst_instance_id, request.dst_write_grant) as grant:
            grant.check()
            if num_bytes <= INLINE_COPY_MAX_BYTES and not request.is_checksum_verified:  # crcs take far longer
                _copy_checked(*copy)
            else:
                await run_in_thread(self._threads.copy, _copy_checked, *copy)
        return num_bytes

    # -- GRPC, GLOO, NCCL --------------------------------------------------------------

    async def _send(self, request: BlockTransfer, deadline: Deadline) -> int:
        source = await self._source(request)
        if request.backend is TransferBackend.GRPC:
            async with self._staging.slot(deadline.remaining_s()) as slot:
                await self._stream(request, source, slot, deadline)
        else:
            await self._send_on_channel(request, source, deadline)
        return source.plan.num_bytes

    async def _source(self, request: BlockTransfer) -> SourceBlocks:
        rows, geometry = self._mappings.rows(request.src_instance_id)
        check_block_ids(request.src_block_ids, geometry.num_blocks, "src_block_ids", is_unique=False)
        check_block_ids(request.dst_block_ids, 2**31, "dst_block_ids", is_unique=True)
        chunk_bytes = self._staging.buffer_bytes
        if request.backend is TransferBackend.GRPC:  # one message per chunk
            chunk_bytes = min(chunk_bytes, self._peers(request.dst_transfer_address).piece_bytes)
        spans = ()
        if request.backend is TransferBackend.GLOO and rows.device.type == "cpu" and self._in_place_min_row_bytes:
            spans = find_in_place_spans(request.src_block_ids, request.dst_block_ids, geometry, chunk_bytes,
                                        self._in_place_min_row_bytes)
        plan = ChunkPlan.for_staging(geometry, request.num_blocks, chunk_bytes, spans)
        checksums = ()
        if request.is_checksum_verified:
            checksums = await run_in_thread(self._threads.copy, block_checksums, rows, request.src_block_ids)
        header = IncomingBlocks(request.dst_instance_id, request.dst_block_ids, geometry, plan.blocks_per_chunk,
                                plan.rows_per_chunk, checksums, self._transfer_id, spans, request.dst_write_grant)
        index = torch.tensor(request.src_block_ids, dtype=torch.int64, device=rows.device)
        return SourceBlocks(rows, request.src_block_ids, index, plan, header)

    def _encode_ahead(self, source: SourceBlocks, slot: StagingSlot) -> GatherAhead:
        """`GatherAhead` whose items are ready ReceiveBlocks data messages, one per chunk."""
        if source.rows.device.type != "cpu":
            def encode_staged(chunk: Chunk, buffer: torch.Tensor) -> bytes:
                staged = gather_chunk(source.rows, source.index, chunk,
                                      staged_view(buffer, source.plan, chunk, source.rows.dtype))
                return encode_data_message(as_bytes(staged))
            return GatherAhead(source.plan, slot, encode_staged, self._threads.copy)
        rows = as_bytes(source.rows)

        def encode(chunk: Chunk, _buffer: torch.Tensor) -> bytes:
            return encode_data_message(*chunk_parts(rows, source.block_ids, chunk))
        return GatherAhead(source.plan, slot, encode, self._threads.copy)

    async def _stream(self, request: BlockTransfer, source: SourceBlocks, slot: StagingSlot, deadline: Deadline) -> None:
        messages = self._encode_ahead(source, slot)
        try:
            await self._peers(request.dst_transfer_address).receive_blocks(
                source.header, _messages(messages), deadline.remaining_s())
        finally:
            await messages.close()

    async def _send_on_channel(self, request: BlockTransfer, source: SourceBlocks, deadline: Deadline) -> None:
        address, backend = request.dst_transfer_address, request.backend

        async def open_remote(store_address: str, rank: int, num_connections: int, channel_id: int) -> int:
            return await self._peers(address).open_channel(self._transfer_id, store_address, rank, backend,
                                                           num_connections, deadline.remaining_s(), channel_id,
                                                           incarnation=self._channels.incarnation)
        channel = await self._channels.outgoing(address, backend, open_remote, deadline.remaining_s())
        staging = self._nccl_staging if backend is TransferBackend.NCCL else self._staging
        # The channel's turn first, then a staging slot: one waiting for a busy peer holds no slot that a
        # transfer to another peer could use.
        with channel.in_use():
            async with channel.transfer_turn(deadline), staging.slot(deadline.remaining_s()) as slot:
                await self._send_and_expect(channel, request, source, slot, deadline)

    async def _send_and_expect(self, channel: PairChannel, request: BlockTransfer, source: SourceBlocks,
                               slot: StagingSlot, deadline: Deadline) -> None:
        channel.check_open()  # not dropped while we waited for its turn and our slot
        tag = next(self._tags) * TAG_STRIDE % 2**31
        sends_done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # True: every message taken
        expect = asyncio.ensure_future(self._expect(channel, source, request, tag, deadline, sends_done))
        try:
            await self._send_chunks(channel, source, slot, tag, deadline)  # drops the channel if a send fails
        except FerryError:
            sends_done.set_result(False)
            # A peer that dropped its end broke our send: its answer says why.
            peer_error = await _peer_answer(expect)
            if peer_error is not None:
                raise peer_error from None
            raise
        except BaseException:  # cancelled, or a bug: the peer's answer goes unread (cancel() marks one already in read)
            expect.cancel()
            raise
        sends_done.set_result(True)
        await expect

    async def _expect(self, channel: PairChannel, source: SourceBlocks, request: BlockTransfer, tag: int,
                      deadline: Deadline, sends_done: asyncio.Future[bool]) -> None:
        try:
            await self._peers(request.dst_transfer_address).expect_blocks(source.header, request.backend, tag,
                                                                          deadline.remaining_s(), channel.channel_id)
        except BaseException as exc:
            # A receiver that refused the blocks takes the rest of our messages and keeps the channel, which
            # other transfers share, so our sends end too. One that did not take them (or is gone) leaves our
            # sends waiting for their deadline: dropping the channel ends them at once.
            if not (isinstance(exc, CLEAN_REFUSALS) and await _ended_well_within(sends_done, PEER_ANSWER_GRACE_S)):
                self._channels.drop_outgoing(request.dst_transfer_address, request.backend, only=channel)
            raise

    async def _send_chunks(self, channel: PairChannel, source: SourceBlocks, slot: StagingSlot, tag: int,
                           deadline: Deadline) -> None:
        """Staged chunks one by one through the buffers; in-place spans straight from the KV memory."""
        ring = BufferRing(slot)
        try:
            for chunks, in_place in segments(source.plan, source.rows, source.block_ids, channel.moves_in_place):
                if not in_place:
                    await self._send_staged(channel, source, ring, chunks, tag, deadline)
                    continue
                await ring.drain()  # tags repeat every TAG_STRIDE chunks: the earlier sends go first
                # Cancelled, drop the channel before waiting for the thread: that ends its sends blocked on a
                # peer that does not receive them, which would otherwise hold it until the deadline.
                await run_in_thread(self._threads.io, move_in_place, channel.send_in_order, source.rows,
                                    source.block_ids, chunks, tag, deadline.remaining_s(),
                                    on_cancel=lambda: self._channels.drop_outgoing(channel.peer, channel.backend,
                                                                                   only=channel))
                IN_PLACE_BYTES.labels("sent").inc(sum(map(source.plan.chunk_bytes, chunks)))
            await ring.drain()
        except BaseException:
            self._channels.drop_outgoing(channel.peer, channel.backend, only=channel)  # unmatched messages may be left
            raise
        finally:
            await ring.close()

    async def _send_staged(self, channel: PairChannel, source: SourceBlocks, ring: BufferRing, chunks: Iterable[Chunk],
                           tag: int, deadline: Deadline) -> None:
        """Gather each chunk into a free buffer and start its send; the buffer stays busy until
        sent, which bounds the chunks in flight."""
        dtype, loop = source.rows.dtype, asyncio.get_running_loop()
        for chunk in chunks:
            buffer = await ring.acquire(chunk.index)
            staged = await run_in_thread(self._threads.copy, gather_chunk, source.rows, source.index, chunk,
                                         staged_view(buffer, source.plan, chunk, dtype))
            if channel.is_serial:
                await ring.wait(chunk.index - 1)  # the previous send, gathered ahead of meanwhile
            flat = staged.view(torch.uint8).view(-1)
            ring.hold(chunk.index, loop.run_in_executor(self._threads.io, channel.send, flat,
                                                        chunk_tag(tag, chunk.index), deadline.remaining_s()))


async def _messages(messages: GatherAhead) -> AsyncIterator[bytes]:
    async for _chunk, message in messages:
        yield message


def _copy_checked(src_rows: torch.Tensor, src_ids: tuple[int, ...], dst_rows: torch.Tensor,
                  dst_ids: tuple[int, ...], is_checksum_verified: bool) -> None:
    copy_blocks(src_rows, src_ids, dst_rows, dst_ids)
    if is_checksum_verified and block_checksums(src_rows, src_ids) != block_checksums(dst_rows, dst_ids):
        raise Aborted("checksum mismatch after a shared-memory copy: the source blocks changed during the copy "
                      "(were they still being written?); redo the transfer")


async def _ended_well_within(sends_done: asyncio.Future[bool], timeout_s: float) -> bool:
    """Whether every send completed within `timeout_s` (False at once if they failed)."""
    done, _ = await asyncio.wait([sends_done], timeout=timeout_s)
    return bool(done) and sends_done.result()


async def _peer_answer(expect: asyncio.Future) -> BaseException | None:
    """The peer's error if it answers within PEER_ANSWER_GRACE_S, else None (and stop waiting, as when
    our caller is cancelled meanwhile: cancel() also reads an answer that came in the same moment)."""
    try:
        done, _ = await asyncio.wait([expect], timeout=PEER_ANSWER_GRACE_S)
    except asyncio.CancelledError:
        expect.cancel()  # else the peer's later answer would go unread
        raise
    if not done:
        expect.cancel()
        await asyncio.wait([expect])
        return None
    return read_error(expect)
