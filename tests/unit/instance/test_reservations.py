"""A migration's reservation that started from cached blocks keeps only those whose bits the source
found equal to its own: the others are let go and fresh blocks take their places, leaking nothing."""

import pytest

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.common.prefix_hash import block_hash
from services.instance.engine.block_manager import OUT_OF_WINDOW_BLOCK, BlockManager
from services.instance.engine.reservations import MigrationId, Reservations

pytestmark = pytest.mark.timeout(10)

M = MigrationId("m-1")
HASHES = [block_hash(b"", [i]) for i in range(4)]


def cached(manager: BlockManager, num_blocks: int, num_shared: int) -> list:
    """`num_blocks` blocks registered under HASHES; the first `num_shared` still held by another request."""
    blocks = manager.allocate_blocks(num_blocks)
    for block_id, block_hash_ in zip(blocks, HASHES):
        manager.prefix_cache.register(block_id, block_hash_)
    manager.free_blocks(blocks[num_shared:])
    return blocks


def test_keeping_fewer_cached_blocks_gives_fresh_ones_in_their_places_and_leaks_nothing():
    manager = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    other = cached(manager, 4, num_shared=3)  # another request holds blocks 0-2; block 3 is idle, evictable
    reservations = Reservations(manager)
    blocks = reservations.reserve(M, 6, HASHES)
    assert blocks[:4] == tuple(other) and reservations.num_cached(M) == 4 and manager.num_free_blocks == 12 - 3 - 3

    kept = reservations.keep_cached(M, 1)

    assert kept[:1] == blocks[:1] and kept[4:] == blocks[4:]  # the request's order: fresh blocks where 1-3 were
    assert not set(kept[1:4]) & set(blocks[1:4]) and len(set(kept)) == 6
    assert reservations.num_cached(M) == 1 and reservations.blocks(M) == kept
    assert [manager.ref_count(b) for b in other] == [2, 1, 1, 0]  # the shared ones lost our hold, block 3 is idle
    assert manager.num_free_blocks == 12 - 3 - 5
    assert reservations.keep_cached(M, 1) == kept  # as many as it has: nothing changes
    assert reservations.free(M)
    manager.free_blocks(other[:3])
    assert manager.num_free_blocks == 12 and all(manager.ref_count(b) == 0 for b in range(12))


def test_keeping_none_when_the_only_free_block_is_the_one_given_up_reuses_it():
    manager = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    cached(manager, 1, num_shared=0)
    reservations = Reservations(manager)
    first = reservations.reserve(M, 2, HASHES[:1])
    assert reservations.keep_cached(M, 0) == first  # evicted and handed out again: no longer cached
    assert reservations.num_cached(M) == 0 and manager.cached_blocks(HASHES[:1]) == []
    assert reservations.free(M) and manager.num_free_blocks == 2


def test_no_room_for_fresh_blocks_leaves_the_reservation_as_it_was():
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    other = cached(manager, 2, num_shared=2)
    reservations = Reservations(manager)
    blocks = reservations.reserve(M, 3, HASHES[:2])
    with pytest.raises(ResourceExhausted, match="fresh KV blocks"):
        reservations.keep_cached(M, 0)
    assert reservations.blocks(M) == blocks and reservations.num_cached(M) == 2
    assert [manager.ref_count(b) for b in other] == [2, 2] and manager.num_free_blocks == 0
    with pytest.raises(InvalidArgument, match="keep_cached_blocks"):
        reservations.keep_cached(M, 3)
    with pytest.raises(NotFound):
        reservations.keep_cached(MigrationId("m-2"), 0)
    assert reservations.free(M)
    manager.free_blocks(other)
    assert manager.num_free_blocks == 3


def test_entries_behind_the_window_are_placeholders_held_by_nobody():
    """num_not_held leading entries (the source no longer holds them): no block is reserved there, cached
    blocks there are not held, keep_cached never swaps a placeholder, and freeing gives back only what is held."""
    manager = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, window=4)
    other = cached(manager, 4, num_shared=0)  # blocks 0-3 cached, idle
    reservations = Reservations(manager)
    blocks = reservations.reserve(M, 7, HASHES, num_not_held=2)
    assert blocks[:2] == (OUT_OF_WINDOW_BLOCK,) * 2 and blocks[2:4] == tuple(other[2:4])
    assert reservations.num_not_held(M) == 2 and reservations.num_cached(M) == 4 and reservations.num_blocks == 5
    assert manager.num_free_blocks == 12 - 5 and [manager.ref_count(b) for b in other] == [0, 0, 1, 1]
    kept = reservations.keep_cached(M, 1)  # below the offset: only the held cached ones are swapped
    assert kept[:2] == blocks[:2] and not set(kept[2:4]) & set(other) and manager.num_free_blocks == 12 - 5
    assert reservations.reserve(M, 9, num_not_held=5)[:7] == kept  # a later call: the same offset, 2 blocks more
    assert reservations.num_blocks == 7
    assert reservations.free(M) and manager.num_free_blocks == 12
    assert all(manager.ref_count(b) == 0 for b in range(12))
    with pytest.raises(InvalidArgument, match="num_leading_blocks_not_held"):
        reservations.reserve(MigrationId("m-2"), 3, num_not_held=4)
    assert len(reservations) == 0
