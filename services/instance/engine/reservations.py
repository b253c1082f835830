"""KV blocks set aside for requests migrating in, by migration id.

The source copies a request's K/V into the blocks reserved for its migration while the
request still runs on the source; the destination then adopts them as the request's
block table. Reserved blocks are allocated from the block manager, so they count as
used (in load reports too) and no local request can take them. A reservation grows
(never shrinks) as the request grows on the source; its blocks stay in the order they
were handed out, which is the order of the request's block table.

A reservation may start with blocks of this instance's prefix cache: the source sends the
hashes of the request's full blocks, and the leading ones cached here already hold the
right K/V. They are shared (other requests may hold them too), so the source never copies
into them. Right K/V by their tokens, that is: their bits depend on how the rows were computed
(decoded one by one, or within a prompt cut elsewhere), so the source compares checksums and may
keep only the first few (`keep_cached`): the others give way to fresh blocks it copies into.

A request whose model has a sliding window on every layer no longer holds the leading blocks behind
its window on the source (block_manager.py): the source names how many (`num_not_held`, first call),
and the reservation keeps `OUT_OF_WINDOW_BLOCK` placeholders in their places, held by nobody, so a
32k-token request with a 4k window reserves its ~257 blocks, not 2048. The import adopts them as its
request's out-of-window entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.common.prefix_hash import BlockHash
from services.instance.engine.block_manager import OUT_OF_WINDOW_BLOCK, BlockId, BlockManager

MigrationId = NewType("MigrationId", str)


class Reservations:
    def __init__(self, block_manager: BlockManager) -> None:
        self._block_manager = block_manager
        # Invariant: past the leading _num_not_held placeholders, every block listed here is held once for
        # the reservation; past the leading _num_cached ones, it is held by nothing else.
        self._blocks: dict[MigrationId, list[BlockId]] = {}
        self._num_cached: dict[MigrationId, int] = {}
        self._num_not_held: dict[MigrationId, int] = {}

    def __contains__(self, migration_id: str) -> bool:
        return migration_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks held for reservations (placeholders not counted)."""
        return sum(len(blocks) - self._num_not_held[m] for m, blocks in self._blocks.items())

    def num_not_held(self, migration_id: MigrationId) -> int:
        """Leading entries of the reservation that are placeholders: behind the request's window on its source."""
        return self._num_not_held.get(migration_id, 0)

    def num_cached(self, migration_id: MigrationId) -> int:
        """Leading blocks of the reservation that came from the prefix cache (nothing to copy into them)."""
        return self._num_cached.get(migration_id, 0)

    def reserve(self, migration_id: MigrationId, num_blocks: int, block_hashes: Sequence[BlockHash] = (),
                num_not_held: int = 0) -> tuple[BlockId, ...]:
        """Grow `migration_id`'s reservation to `num_blocks` entries in all; every entry, in order.
        A new reservation starts with `num_not_held` placeholders (read on the first call only), then the
        cached blocks of the longest prefix of `block_hashes` past them."""
        is_new = migration_id not in self._blocks
        if is_new:
            if not 0 <= num_not_held <= num_blocks:
                raise InvalidArgument(f"num_leading_blocks_not_held: must be in [0, num_blocks={num_blocks}], "
                                      f"got {num_not_held}")
            self._start(migration_id, block_hashes[:num_blocks], num_not_held)
        blocks = self._blocks[migration_id]
        num_more = max(num_blocks - len(blocks), 0)
        if not self._block_manager.can_allocate(num_more):
            num_not_held = self._num_not_held[migration_id]
            if is_new:  # a first call that fails holds nothing
                self.free(migration_id)
            raise ResourceExhausted(
                f"cannot reserve {num_blocks - num_not_held} KV blocks for migration "
                f"{migration_id}: {len(blocks) - num_not_held} reserved, "
                f"{self._block_manager.num_free_blocks} free; pick another destination")
        blocks.extend(self._block_manager.allocate_blocks(num_more))
        return tuple(blocks)

    def keep_cached(self, migration_id: MigrationId, num_kept: int) -> tuple[BlockId, ...]:
        """Keep only the first `num_kept` cached blocks: the others are let go (one holder less) and fresh
        blocks take their places, so the order stays the request's; every block held, in order."""
        blocks = list(self.blocks(migration_id))  # NotFound if none
        num_cached = self._num_cached[migration_id]
        if not 0 <= num_kept <= num_cached:
            raise InvalidArgument(f"keep_cached_blocks: must be in [0, {num_cached}] (the cached blocks migration "
                                  f"{migration_id} started with), got {num_kept}")
        given_up = blocks[max(num_kept, self._num_not_held[migration_id]):num_cached]  # placeholders stay
        self._block_manager.free_blocks(given_up)  # first: one nobody else holds may be the fresh one
        if not self._block_manager.can_allocate(len(given_up)):
            self._block_manager.hold_cached(given_up)  # as it was: still registered, nothing ran in between
            raise ResourceExhausted(
                f"cannot put {len(given_up)} fresh KV blocks in place of cached ones for migration {migration_id}: "
                f"{self._block_manager.num_free_blocks} free; pick another destination")
        blocks[num_cached - len(given_up):num_cached] = self._block_manager.allocate_blocks(len(given_up))
        self._blocks[migration_id] = blocks
        self._num_cached[migration_id] = num_kept
        return tuple(blocks)

    def blocks(self, migration_id: MigrationId) -> tuple[BlockId, ...]:
        if migration_id not in self._blocks:
            raise NotFound(f"migration {migration_id} holds no reservation here (expired or aborted); "
                           "start the migration again")
        return tuple(self._blocks[migration_id])

    def take(self, migration_id: MigrationId) -> list[BlockId]:
        """Hand the reserved blocks over to their new holder (a request's block table)."""
        self.blocks(migration_id)  # NotFound if none
        self._num_cached.pop(migration_id)
        self._num_not_held.pop(migration_id)
        return self._blocks.pop(migration_id)

    def free(self, migration_id: MigrationId) -> bool:
        """Give the reserved blocks back to the free list; False if there was no reservation."""
        blocks = self._blocks.pop(migration_id, None)
        if blocks is None:
            return False
        self._num_cached.pop(migration_id)
        self._block_manager.free_blocks(blocks[self._num_not_held.pop(migration_id):])
        return True

    def _start(self, migration_id: MigrationId, block_hashes: Sequence[BlockHash], num_not_held: int) -> None:
        cached = self._block_manager.cached_blocks(block_hashes)
        self._block_manager.hold_cached(cached[num_not_held:])
        self._blocks[migration_id] = [OUT_OF_WINDOW_BLOCK] * num_not_held + cached[num_not_held:]
        self._num_cached[migration_id] = len(cached)
        self._num_not_held[migration_id] = num_not_held
