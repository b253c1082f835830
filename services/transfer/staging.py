"""Preallocated staging memory: slots of a few buffers each, handed out one slot per transfer.

Every buffer is allocated and touched once at startup; transfers never allocate
block-sized memory. A transfer holds one slot for its whole life, so the number of slots
bounds the transfers in flight; a transfer that cannot get one before its deadline fails
with RESOURCE_EXHAUSTED. A service keeps one pool for sending and one for receiving: a
send waits for its receive, so the two must never compete for the same slots.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from services.common.errors import ResourceExhausted


@dataclass(frozen=True, slots=True)
class StagingSlot:
    buffers: tuple[torch.Tensor, ...]  # flat uint8, at least two; chunk i uses buffers[i % len(buffers)]


class StagingPool:
    def __init__(self, num_slots: int, buffer_bytes: int, buffers_per_slot: int = 2,
                 device: torch.device | str = "cpu") -> None:
        if buffers_per_slot < 2:
            raise ValueError(f"a staging slot needs at least two buffers, got {buffers_per_slot}")
        self.num_slots = num_slots
        self.buffer_bytes = buffer_bytes
        self.slots = tuple(StagingSlot(tuple(_allocate(buffer_bytes, device) for _ in range(buffers_per_slot)))
                           for _ in range(num_slots))
        self._free: asyncio.Queue[StagingSlot] = asyncio.Queue(maxsize=num_slots)
        for slot in self.slots:
            self._free.put_nowait(slot)

    @property
    def num_free(self) -> int:
        return self._free.qsize()

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[StagingSlot]:
        try:
            async with asyncio.timeout(timeout_s):
                slot = await self._free.get()
        except TimeoutError:
            raise ResourceExhausted(f"all {self.num_slots} staging slots stayed busy for {timeout_s:.1f} s; "
                                    "retry later or raise --num-staging-slots") from None
        try:
            yield slot
        finally:
            self._free.put_nowait(slot)


def _allocate(num_bytes: int, device: torch.device | str) -> torch.Tensor:
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    buffer.fill_(0)  # fault the pages in now, not during the first transfer
    return buffer
