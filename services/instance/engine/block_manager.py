"""Which KV cache blocks are free, and which request holds which.

A block holds the K/V of `block_size` consecutive tokens of one sequence. Blocks
are handed out lowest id first (so blocks allocated together are usually consecutive,
which lets attention read a long sequence's cache in place) and carry a reference count (1 per holder; more
than one once blocks are shared, e.g. by prefix caching or a migration that
reads them). A block goes back to the free list when its count drops to 0.

A request's blocks are its `block_table`: token t lives in `block_table[t // block_size]`.

Sliding windows: where every layer of the model attends through a window of W tokens (`window`), a
block all of whose positions are at least W behind the next token to compute is never read again,
so it goes back (`drop_out_of_window`). Its entry in the block table becomes `OUT_OF_WINDOW_BLOCK`,
so positions still index the table; `Request.num_dropped_blocks` says how many leading entries
these are. A request then holds at most `max_blocks_held` blocks once its prompt is computed.

With prefix caching (prefix_cache.py), a full block whose K/V are computed is registered
under the hash of its tokens; when its count drops to 0 it stays findable (*evictable*)
and is handed out again only when no other free block is left.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

from services.common.errors import Internal, ResourceExhausted
from services.common.prefix_hash import BlockHash
from services.instance.engine.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from services.instance.engine.request import Request

BlockId = NewType("BlockId", int)
# What a block table keeps in place of a block given back out of the window: any real block would do (attention
# masks those positions); only `Request.num_dropped_blocks` says which entries these are.
OUT_OF_WINDOW_BLOCK = BlockId(0)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def max_blocks_held(num_tokens: int, block_size: int, window: int | None) -> int:
    """The most blocks a sequence of `num_tokens` tokens holds at once while it decodes: all of them, or with
    a window on every layer, those spanning the window's W keys (ceil(W / block_size) + 1 at most)."""
    num_blocks = num_blocks_for(num_tokens, block_size)
    return num_blocks if window is None else min(num_blocks, num_blocks_for(window, block_size) + 1)


def num_blocks_out_of_window(num_computed_tokens: int, block_size: int, window: int | None) -> int:
    """Leading blocks the next token (position `num_computed_tokens`) and every later one no longer read: their
    positions are all <= position - window (a query at p sees keys p - window < j <= p)."""
    return 0 if window is None else max(num_computed_tokens - window + 1, 0) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Invariant: a block has ref count 0 exactly when it is in _free_blocks (a min-heap of
        # never-registered blocks) or evictable in the prefix cache.
        self._ref_counts = [0] * num_blocks
        self._free_blocks: list[BlockId] = [BlockId(i) for i in range(num_blocks)]
        self.prefix_cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self.window = window  # every layer's sliding window (the widest), or None: some layer reads everything
        self.num_blocks_dropped = 0  # blocks given back out of the window since start

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks) + self._num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def _num_evictable(self) -> int:
        return self.prefix_cache.num_evictable if self.prefix_cache else 0

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref_counts[block_id]

    # Blocks, whoever holds them.

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_blocks(self, num_blocks: int) -> list[BlockId]:
        """Take `num_blocks` free blocks (ref count 1 each): never-cached ones first, then the
        least recently released cached ones (which the cache forgets)."""
        if not self.can_allocate(num_blocks):
            raise ResourceExhausted(
                f"KV cache full: {num_blocks} blocks asked, {self.num_free_blocks} free; raise --num-blocks"
            )
        blocks = [self._pop_free_block() for _ in range(num_blocks)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def _pop_free_block(self) -> BlockId:
        if self._free_blocks:
            return heapq.heappop(self._free_blocks)
        assert self.prefix_cache is not None  # can_allocate counted evictable blocks only if there is a cache
        return self.prefix_cache.evict_oldest()

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
                self._release(block_id)

    def _release(self, block_id: BlockId) -> None:
        if self.prefix_cache is not None and self.prefix_cache.is_registered(block_id):
            self.prefix_cache.release(block_id)
        else:
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
        """Release every block `request` holds and empty its block table.

        Last block first, so that of a released sequence the cache evicts its tail before its prefix."""
        blocks, request.block_table = request.block_table[request.num_dropped_blocks:], []
        request.num_registered_blocks = 0
        request.num_dropped_blocks = 0
        self.free_blocks(blocks[::-1])

    def max_blocks_held(self, num_tokens: int) -> int:
        return max_blocks_held(num_tokens, self.block_size, self.window)

    def drop_out_of_window(self, request: Request) -> None:
        """Give back `request`'s leading blocks that no layer reads again (none without a window on every
        layer). Call before scheduling its next tokens; a registered block stays cached (evictable)."""
        num_out = min(num_blocks_out_of_window(request.num_computed_tokens, self.block_size, self.window),
                      len(request.block_table))
        first = request.num_dropped_blocks
        if num_out <= first:
            return
        blocks = request.block_table[first:num_out]
        request.block_table[first:num_out] = [OUT_OF_WINDOW_BLOCK] * (num_out - first)
        request.num_dropped_blocks = num_out
        request.num_registered_blocks = max(request.num_registered_blocks, num_out)  # never register a placeholder
        self.free_blocks(blocks)
        self.num_blocks_dropped += len(blocks)

    def adopt_out_of_window(self, request: Request, num_not_held: int) -> None:
        """`request` (migrated in, its block table fresh from a reservation) has `num_not_held` leading
        placeholders that nobody holds: count them as given back out of the window, never registered."""
        request.num_dropped_blocks = max(request.num_dropped_blocks, num_not_held)
        request.num_registered_blocks = max(request.num_registered_blocks, num_not_held)

    # Prefix caching (no-ops without a prefix cache).

    def cached_prefix(self, request: Request) -> list[BlockId]:
        """The cached blocks `request` can start from: the longest run of its leading full blocks, leaving at
        least its last token to compute (its logits give the next token), and none from its first block that
        another request's block was registered for (`Request.first_foreign_block`)."""
        if self.prefix_cache is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.first_foreign_block is not None:
            max_blocks = min(max_blocks, request.first_foreign_block)
        return self.cached_blocks(request.block_hashes(self.block_size, max_blocks))

    def num_blocks_for_chunk(self, start: int, end: int) -> int:
        """Blocks a request computing tokens `start` to `end` holds in that step: those its window still reads
        at `start` (all, without a window) to the last."""
        return num_blocks_for(end, self.block_size) - num_blocks_out_of_window(start, self.block_size, self.window)

    def num_blocks_to_admit(self, cached: list[BlockId], num_tokens: int) -> int:
        """Free blocks that admitting a request with `cached` as its first blocks and room for `num_tokens`
        tokens uses up: its new blocks, plus the cached ones nobody holds (they stop counting as free) that
        are not out of the window already (those go back at once: `drop_out_of_window`)."""
        num_out = num_blocks_out_of_window(len(cached) * self.block_size, self.block_size, self.window)
        num_idle_cached = sum(self._ref_counts[b] == 0 for b in cached[num_out:])
        return max(num_blocks_for(num_tokens, self.block_size) - len(cached), 0) + num_idle_cached

    def cached_blocks(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """The cached blocks of the longest leading run of `hashes` (none without a prefix cache)."""
        return self.prefix_cache.longest_prefix(hashes) if self.prefix_cache is not None else []

    def hold_cached(self, cached: list[BlockId]) -> None:
        """One more holder for each cached block (idle ones stop being evictable)."""
        for block_id in cached:
            if self._ref_counts[block_id] == 0:
                assert self.prefix_cache is not None
                self.prefix_cache.reclaim(block_id)
            self._ref_counts[block_id] += 1

    def start_from_cache(self, request: Request, cached: list[BlockId]) -> None:
        """Give a request without blocks the cached blocks of its prefix (computed: no work left in them)."""
        if request.block_table:
            raise Internal(f"request {request.request_id} already holds blocks; only a new request starts from cache")
        self.hold_cached(cached)
        request.block_table = list(cached)
        request.num_registered_blocks = len(cached)
        request.num_computed_tokens = len(cached) * self.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.count_admission(request.num_tokens, request.num_computed_tokens)

    def register_computed(self, request: Request) -> None:
        """Register `request`'s full blocks whose K/V are now in the cache (call after the step that wrote them)."""
        if self.prefix_cache is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        if num_full <= request.num_registered_blocks:
            return
        hashes = request.block_hashes(self.block_size, num_full)
        for i in range(request.num_registered_blocks, num_full):
            is_own = self.prefix_cache.register(request.block_table[i], hashes[i])
            if not is_own and (request.first_foreign_block is None or i < request.first_foreign_block):
                request.first_foreign_block = i
        request.num_registered_blocks = num_full

    def _check_held(self, block_ids: list[BlockId]) -> None:
        drops: dict[BlockId, int] = {}
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise Internal(f"block {block_id} does not exist (the cache has {self.num_blocks})")
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, num_drops in drops.items():
            if num_drops > self._ref_counts[block_id]:
                raise Internal(f"block {block_id} freed more times than it is held (double free)")
