"""KV blocks set aside for requests migrating in, by migration id.

The source copies a request's K/V into the blocks reserved for its migration while the
request still runs on the source; the destination then adopts them as the request's
block table. Reserved blocks are allocated from the block manager, so they count as
used (in load reports too) and no local request can take them. A reservation grows
(never shrinks) as the request grows on the source; its blocks stay in the order they
were handed out, which is the order of the request's block table.
"""

from __future__ import annotations

from typing import NewType

from services.common.errors import NotFound, ResourceExhausted
from services.instance.engine.block_manager import BlockId, BlockManager

MigrationId = NewType("MigrationId", str)


class Reservations:
    def __init__(self, block_manager: BlockManager) -> None:
        self._block_manager = block_manager
        # Invariant: every block listed here is allocated (ref count 1) and in no block table.
        self._blocks: dict[MigrationId, list[BlockId]] = {}

    def __contains__(self, migration_id: str) -> bool:
        return migration_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    def reserve(self, migration_id: MigrationId, num_blocks: int) -> tuple[BlockId, ...]:
        """Grow `migration_id`'s reservation to `num_blocks` blocks in all; every block it holds, in order."""
        blocks = self._blocks.setdefault(migration_id, [])
        num_more = max(num_blocks - len(blocks), 0)
        if not self._block_manager.can_allocate(num_more):
            if not blocks:
                del self._blocks[migration_id]
            raise ResourceExhausted(
                f"cannot reserve {num_blocks} KV blocks for migration {migration_id}: {len(blocks)} reserved, "
                f"{self._block_manager.num_free_blocks} free; pick another destination")
        blocks.extend(self._block_manager.allocate_blocks(num_more))
        return tuple(blocks)

    def blocks(self, migration_id: MigrationId) -> tuple[BlockId, ...]:
        if migration_id not in self._blocks:
            raise NotFound(f"migration {migration_id} holds no reservation here (expired or aborted); "
                           "start the migration again")
        return tuple(self._blocks[migration_id])

    def take(self, migration_id: MigrationId) -> list[BlockId]:
        """Hand the reserved blocks over to their new holder (a request's block table)."""
        self.blocks(migration_id)  # NotFound if none
        return self._blocks.pop(migration_id)

    def free(self, migration_id: MigrationId) -> bool:
        """Give the reserved blocks back to the free list; False if there was no reservation."""
        blocks = self._blocks.pop(migration_id, None)
        if blocks is None:
            return False
        self._block_manager.free_blocks(blocks)
        return True
