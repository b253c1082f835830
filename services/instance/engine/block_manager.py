"""Which KV cache blocks are free, and which request holds which.

A block holds the K/V of `block_size` consecutive tokens of one sequence. Blocks
are handed out lowest id first (so blocks allocated together are usually consecutive,
which lets attention read a long sequence's cache in place) and carry a reference count (1 per holder; more
than one once blocks are shared, e.g. by prefix caching or a migration that
reads them). A block goes back to the free list when its count drops to 0.

A request's blocks are its `block_table`: token t lives in `block_table[t // block_size]`.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NewType

from services.common.errors import Internal, ResourceExhausted

if TYPE_CHECKING:
    from services.instance.engine.request import Request

BlockId = NewType("BlockId", int)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Invariant: a block is in _free_blocks (a min-heap) exactly when its ref count is 0.
        self._ref_counts = [0] * num_blocks
        self._free_blocks: list[BlockId] = [BlockId(i) for i in range(num_blocks)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref_counts[block_id]

    # Blocks, whoever holds them.

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_blocks)

    def allocate_blocks(self, num_blocks: int) -> list[BlockId]:
        """Take `num_blocks` free blocks (ref count 1 each)."""
        if not self.can_allocate(num_blocks):
            raise ResourceExhausted(
                f"KV cache full: {num_blocks} blocks asked, {self.num_free_blocks} free; raise --num-blocks"
            )
        blocks = [heapq.heappop(self._free_blocks) for _ in range(num_blocks)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share_blocks(self, block_ids: list[BlockId]) -> None:
        """Add a holder to blocks that are already allocated."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise Internal(f"block {block_id} is free; only allocated blocks can be shared")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free_blocks(self, block_ids: list[BlockId]) -> None:
        """Drop one holder of each block; blocks nobody holds go back to the free list."""
        self._check_held(block_ids)
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                heapq.heappush(self._free_blocks, block_id)

    # Blocks of a request (its block table).

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` must add to its table to hold its first `num_tokens` tokens."""
        return max(num_blocks_for(num_tokens, self.block_size) - len(request.block_table), 0)

    def allocate(self, request: Request, num_tokens: int | None = None) -> None:
        """Grow `request`'s block table to hold `num_tokens` tokens (default: all it has)."""
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        request.block_table.extend(self.allocate_blocks(self.num_blocks_needed(request, num_tokens)))

    def can_append_slot(self, request: Request) -> bool:
        return self.can_allocate(self.num_blocks_needed(request, request.num_computed_tokens + 1))

    def append_slot(self, request: Request) -> None:
        """Make room for `request`'s next token (a new block when it crosses a block boundary)."""
        self.allocate(request, request.num_computed_tokens + 1)

    def free(self, request: Request) -> None:
        """Release every block of `request` and empty its block table."""
        blocks, request.block_table = request.block_table, []
        self.free_blocks(blocks)

    def _check_held(self, block_ids: list[BlockId]) -> None:
        drops: dict[BlockId, int] = {}
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise Internal(f"block {block_id} does not exist (the cache has {self.num_blocks})")
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, num_drops in drops.items():
            if num_drops > self._ref_counts[block_id]:
                raise Internal(f"block {block_id} freed more times than it is held (double free)")
