"""Automatic prefix caching: full KV blocks stay findable by the hash of their tokens.

Once a block is full and its K/V are in the cache, it is registered under its chained
hash (services/common/prefix_hash.py: the hash covers every token from the start of the
sequence to the end of the block). A new request whose leading blocks hash the same
takes those blocks as they are (one more holder each) and starts computing after them.

A registered block whose last holder lets go is not wiped: it becomes *evictable*. It
still counts as free, and it is only reused, and forgotten, when no never-cached free
block is left, least recently released first. So caching never costs a request a block.

Only full blocks are shared, and a request never writes into a block before its
`num_computed_tokens`, so shared blocks are read-only. A request whose context is all
cached still recomputes its last token: its logits give the next token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.prefix_hash import BlockHash

if TYPE_CHECKING:
    from services.instance.engine.block_manager import BlockId


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    num_queried_tokens: int  # context tokens of admitted requests (the most that could have hit)
    num_hit_tokens: int  # of those, tokens whose K/V came from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


NO_PREFIX_CACHE_STATS = PrefixCacheStats(0, 0)  # what an engine without a prefix cache reports


class PrefixCache:
    """Hash ↔ block index of the registered blocks, and the evictable ones in release order."""

    def __init__(self) -> None:
        # Invariant: _block_of[h] == b exactly when _hash_of[b] == h; every evictable block is registered.
        self._block_of: dict[BlockHash, BlockId] = {}
        self._hash_of: dict[BlockId, BlockHash] = {}
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()  # oldest release first
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_registered(self) -> int:
        return len(self._hash_of)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.num_queried_tokens, self.num_hit_tokens)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """The registered blocks of the longest leading run of `hashes`."""
        blocks: list[BlockId] = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def register(self, block_id: BlockId, block_hash: BlockHash) -> bool:
        """Make a held, full block findable; a no-op if the hash or the block is registered already. False where
        another block holds the hash (the same tokens, computed by another request): this one stays unfindable."""
        holder = self._block_of.get(block_hash)
        if holder is not None or block_id in self._hash_of:
            return holder in (None, block_id)
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def is_registered(self, block_id: BlockId) -> bool:
        return block_id in self._hash_of

    def release(self, block_id: BlockId) -> None:
        """A registered block's last holder let go: keep it findable, evict it last."""
        self._evictable[block_id] = None

    def reclaim(self, block_id: BlockId) -> None:
        """An evictable block found a holder again."""
        del self._evictable[block_id]

    def evict_oldest(self) -> BlockId:
        """Forget the least recently released evictable block and hand it out for reuse."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        return block_id

    def count_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens
