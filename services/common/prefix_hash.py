"""Chained hashes of a token sequence's full blocks: the keys of prefix caching.

Block i's hash covers tokens [0, (i + 1) * block_size): it hashes block i's token ids
together with block i-1's hash, so two sequences share block i's hash exactly when
they share every token up to the end of that block. Only full blocks are hashed.

The hash is BLAKE2b, not Python's `hash`: a user must not be able to craft a prompt
whose blocks collide with another user's cached blocks (and read its K/V), and every
process (frontends, manager, instances) must compute the same value.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = b""  # the parent of block 0
_DIGEST_BYTES = 16
# The granularity frontends hash prompts at for the manager's `prefix` policy. Instances hash
# at their own block size; the manager only needs to recognise shared prefixes, not blocks.
DISPATCH_CHUNK_TOKENS = 16
# The most chunk keys a frontend sends with one dispatch (4096 prompt tokens); the manager refuses more.
MAX_PREFIX_CHUNKS = 256


MAX_CACHE_SALT_CHARS = 256


def root_hash(cache_salt: str = "") -> BlockHash:
    """The parent of block 0: `ROOT_HASH`, or one of the salt's own, so differently salted sequences never
    share a block hash (vLLM's `cache_salt`: tenants cannot probe each other's cached prompts by timing)."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.blake2b(b"cache_salt:" + cache_salt.encode(), digest_size=_DIGEST_BYTES).digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block whose predecessor hashed to `parent`."""
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=_DIGEST_BYTES).digest()


def next_block_hash(chain: Sequence[BlockHash], token_ids: Sequence[int], cache_salt: str = "") -> BlockHash:
    """The hash of the block after `chain` (the hashes of the blocks before it), holding `token_ids`."""
    return block_hash(chain[-1] if chain else root_hash(cache_salt), token_ids)


def prefix_chunk_keys(token_ids: Sequence[int], max_chunks: int, cache_salt: str = "") -> list[int]:
    """The first `max_chunks` chained hashes of `token_ids` in `DISPATCH_CHUNK_TOKENS`-token chunks, as
    unsigned 64-bit ints (what a frontend sends the manager with a dispatch)."""
    hashes: list[BlockHash] = []
    for i in range(min(len(token_ids) // DISPATCH_CHUNK_TOKENS, max_chunks)):
        hashes.append(next_block_hash(hashes, token_ids[i * DISPATCH_CHUNK_TOKENS:(i + 1) * DISPATCH_CHUNK_TOKENS],
                                      cache_salt))
    return [int.from_bytes(h[:8], "little") for h in hashes]
