"""Overlapping gather, send and scatter over a slot's staging buffers (chunk i uses buffer i % n).

Sender: `GatherAhead` stages chunk i+1 into one buffer on a worker thread while the
caller sends chunk i from another (grpc). Channel sends (gloo, nccl) instead keep several
chunks in flight at once: each buffer is busy in a `BufferRing` until its send is done.
Receiver: `ScatterBehind` scatters chunk i from one buffer on a worker thread while the
caller receives the next chunks into the others.

Scatters run on a one-thread executor, in chunk order (checksums chain over row chunks),
and none runs after one has failed.

Invariant: a buffer is never written while a thread still reads it, and the slot
holding both buffers is released only after `close()` has waited for every thread the
pipeline started (threads cannot be cancelled; each one ends by itself, bounded by the
transfer's deadline). Futures are awaited through `asyncio.shield` so a cancelled
caller leaves them observable to `close()`, which also takes every error left unread (a
broken channel fails every chunk in flight; the caller raises the first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from services.transfer.chunk_plan import Chunk, ChunkPlan
from services.transfer.staging import StagingSlot
from services.transfer.threads import wait_for_threads

GatherFn = Callable[[Chunk, torch.Tensor], torch.Tensor]  # (chunk, buffer) → the staged view
ScatterFn = Callable[[Chunk, torch.Tensor], None]  # (chunk, staged view) → None


class GatherAhead:
    """`async for chunk, staged in GatherAhead(...)`: each staged view is valid until the next step."""

    def __init__(self, plan: ChunkPlan, slot: StagingSlot, gather: GatherFn, executor: Executor) -> None:
        self._chunks = list(plan.chunks())
        self._slot = slot
        self._gather = gather
        self._executor = executor
        self._next = 0
        self._pending: asyncio.Future | None = None  # gather of chunk `_next`, if started
        self._is_closed = False  # no gather starts after close() (grpc may still poll the iterator then)

    def __aiter__(self) -> GatherAhead:
        return self

    async def __anext__(self) -> tuple[Chunk, torch.Tensor]:
        if self._next >= len(self._chunks) or self._is_closed:
            raise StopAsyncIteration
        if self._pending is None:
            self._pending = self._start(self._next)
        staged = await asyncio.shield(self._pending)
        if self._is_closed:  # closed while we waited: the slot is being given back
            raise StopAsyncIteration
        chunk = self._chunks[self._next]
        self._next += 1
        # The caller is done with the buffer of chunk `_next - 2`: gather into it now.
        self._pending = self._start(self._next) if self._next < len(self._chunks) else None
        return chunk, staged

    async def close(self) -> None:
        """Wait for the gather in flight (its error, if any, is the caller's to ignore: it is already
        failing); none starts after this is called."""
        self._is_closed = True
        while self._pending is not None:
            pending = self._pending
            await wait_for_threads([pending])
            if self._pending is pending:
                self._pending = None

    def _start(self, index: int) -> asyncio.Future:
        chunk = self._chunks[index]
        buffer = self._slot.buffers[index % len(self._slot.buffers)]
        return asyncio.get_running_loop().run_in_executor(self._executor, self._gather, chunk, buffer)


class BufferRing:
    """The slot's buffers in turn, each busy until the work last started on it is done.

    `await acquire(i)` returns buffer i % n once its work (a send reading it, a receive
    writing it, a scatter reading it) has finished, and raises that work's error;
    `hold(i, future)` marks it busy again. `drain()` waits for all and raises the first
    error; `close()` waits for all whatever they did (the caller is already failing).
    """

    def __init__(self, slot: StagingSlot) -> None:
        self._buffers = slot.buffers
        self._busy: list[asyncio.Future | None] = [None] * len(slot.buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    async def acquire(self, index: int) -> torch.Tensor:
        await self.wait(index)
        return self._buffers[index % len(self._buffers)]

    async def wait(self, index: int) -> None:
        """Wait for the work on chunk `index`'s buffer (raise its error)."""
        await self._wait(index % len(self._buffers))

    def hold(self, index: int, future: asyncio.Future) -> None:
        self._busy[index % len(self._buffers)] = future

    async def drain(self) -> None:
        for position in range(len(self._buffers)):
            await self._wait(position)

    async def close(self) -> None:
        # The first error already raised (`drain`): the others are the same break, read here.
        await wait_for_threads(future for future in self._busy if future is not None)
        # A failed future holds its error, whose traceback holds the frames that hold this ring: without
        # this, that cycle (and the channel in those frames) would live until the garbage collector ran.
        self._busy = [None] * len(self._buffers)

    async def _wait(self, position: int) -> None:
        future = self._busy[position]
        if future is not None:
            try:
                await asyncio.shield(future)
            finally:
                if future.done():
                    self._busy[position] = None


class ScatterBehind:
    """Receive into `await buffer_for(chunk)`, then `submit(chunk, staged)`; `finish()` at the end."""

    def __init__(self, slot: StagingSlot, scatter: ScatterFn, executor: Executor) -> None:
        self._ring = BufferRing(slot)
        self._scatter = scatter
        self._executor = executor
        self._has_failed = False  # after a failed chunk (e.g. a checksum), later chunks are not applied

    async def buffer_for(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's buffer, once the scatter still reading it has finished (its error raises here)."""
        return await self._ring.acquire(chunk.index)

    def submit(self, chunk: Chunk, staged: torch.Tensor) -> None:
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._scatter_unless_failed, chunk, staged)
        self._ring.hold(chunk.index, future)

    async def finish(self) -> None:
        """Wait for every scatter; raise the first error."""
        await self._ring.drain()

    async def close(self) -> None:
        """Wait for every scatter, errors or not (the caller is already failing)."""
        await self._ring.close()

    def _scatter_unless_failed(self, chunk: Chunk, staged: torch.Tensor) -> None:
        if self._has_failed:
            return
        try:
            self._scatter(chunk, staged)
        except BaseException:
            self._has_failed = True
            raise
