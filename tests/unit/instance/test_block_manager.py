"""BlockManager: free list, reference counts, block tables that grow token by token."""

import pytest

from services.common.errors import Internal, ResourceExhausted
from services.instance.engine.block_manager import OUT_OF_WINDOW_BLOCK, BlockManager, max_blocks_held, num_blocks_for
from services.instance.engine.request import Request, RequestId, SamplingParams
from services.instance.engine.text_output import TextOutput

pytestmark = pytest.mark.timeout(10)


class _NoText:
    def feed(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_request(num_prompt_tokens: int, name: str = "r") -> Request:
    return Request(RequestId(name), tuple(range(1, num_prompt_tokens + 1)), SamplingParams(), seed=0,
                   arrival_order=0, text=TextOutput(_NoText(), ()))


def test_num_blocks_for_rounds_up():
    assert [num_blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_covers_prompt_and_free_returns_everything():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(9)
    assert manager.can_allocate(manager.num_blocks_needed(request, request.num_tokens))
    manager.allocate(request)
    assert len(request.block_table) == 3
    assert len(set(request.block_table)) == 3
    assert manager.num_free_blocks == 5
    manager.free(request)
    assert request.block_table == []
    assert manager.num_free_blocks == 8


def test_append_slot_adds_a_block_only_at_a_boundary():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(3)
    manager.allocate(request)
    request.num_computed_tokens = 3
    for num_computed, expected_blocks in ((3, 1), (4, 2), (5, 2), (7, 2), (8, 3)):
        request.num_computed_tokens = num_computed
        manager.append_slot(request)
        assert len(request.block_table) == expected_blocks, num_computed
    assert manager.num_free_blocks == 5


def test_allocate_is_incremental_for_chunks():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(10)
    manager.allocate(request, 4)
    first = list(request.block_table)
    manager.allocate(request, 10)
    assert request.block_table[:1] == first and len(request.block_table) == 3


def test_cannot_allocate_more_than_free():
    manager = BlockManager(num_blocks=2, block_size=4)
    assert manager.can_allocate(2) and not manager.can_allocate(3)
    request = make_request(9)
    with pytest.raises(ResourceExhausted, match="num-blocks"):
        manager.allocate(request)
    assert manager.num_free_blocks == 2 and request.block_table == []


def test_double_free_raises_and_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=4)
    blocks = manager.allocate_blocks(2)
    manager.free_blocks(blocks)
    with pytest.raises(Internal, match="double free"):
        manager.free_blocks(blocks)
    assert manager.num_free_blocks == 4
    with pytest.raises(Internal, match="double free"):
        manager.free_blocks([manager.allocate_blocks(1)[0]] * 2)
    assert manager.num_free_blocks == 3


def test_unknown_block_raises():
    manager = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(Internal, match="does not exist"):
        manager.free_blocks([7])


def test_shared_blocks_return_after_last_holder():
    manager = BlockManager(num_blocks=4, block_size=4)
    blocks = manager.allocate_blocks(2)
    manager.share_blocks(blocks)
    assert [manager.ref_count(b) for b in blocks] == [2, 2]
    manager.free_blocks(blocks)
    assert manager.num_free_blocks == 2
    manager.free_blocks(blocks)
    assert manager.num_free_blocks == 4
    with pytest.raises(Internal, match="free"):
        manager.share_blocks(blocks)


def test_freed_blocks_are_reused():
    manager = BlockManager(num_blocks=3, block_size=2)
    a, b = make_request(4, "a"), make_request(2, "b")
    manager.allocate(a)
    manager.allocate(b)
    assert manager.num_free_blocks == 0
    manager.free(a)
    c = make_request(4, "c")
    manager.allocate(c)
    assert sorted(c.block_table + b.block_table) == [0, 1, 2]


# Sliding windows: blocks behind every layer's window go back.

def test_blocks_behind_the_window_go_back_and_the_table_keeps_placeholders():
    manager = BlockManager(num_blocks=16, block_size=4, window=7)
    request = make_request(30)
    manager.allocate(request)
    held = list(request.block_table)
    for num_computed, num_out in ((5, 0), (9, 0), (10, 1), (13, 1), (14, 2), (29, 5)):
        request.num_computed_tokens = num_computed  # the next token sits at position num_computed
        manager.drop_out_of_window(request)
        # block b goes once its last position, 4b + 3, is at or behind num_computed - 7
        assert request.num_dropped_blocks == num_out, num_computed
        assert request.block_table[:num_out] == [OUT_OF_WINDOW_BLOCK] * num_out
        assert request.block_table[num_out:] == held[num_out:]
        assert manager.num_free_blocks == 16 - 8 + num_out
    assert manager.num_blocks_dropped == 5
    manager.free(request)  # only the blocks still held: no double free of the placeholders
    assert manager.num_free_blocks == 16 and request.num_dropped_blocks == 0


def test_without_a_window_on_every_layer_nothing_goes_back():
    manager = BlockManager(num_blocks=16, block_size=4)
    request = make_request(30)
    manager.allocate(request)
    request.num_computed_tokens = 29
    manager.drop_out_of_window(request)
    assert request.num_dropped_blocks == 0 and manager.num_free_blocks == 8


def _request_of(tokens: range, name: str) -> Request:
    return Request(RequestId(name), tuple(tokens), SamplingParams(), seed=0, arrival_order=0,
                   text=TextOutput(_NoText(), ()))


def test_a_block_given_back_before_it_registered_never_registers():
    """An imported request gives back the blocks behind its window (never copied into) before registering."""
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, window=5)
    request = _request_of(range(1, 17), "imported")
    manager.allocate(request)
    request.num_computed_tokens = 12  # the next token, at 12, sees keys 8-12: blocks 0 (0-3) and 1 (4-7) are out
    manager.drop_out_of_window(request)
    manager.register_computed(request)
    assert request.num_dropped_blocks == 2 and request.num_registered_blocks == 3
    assert manager.prefix_cache.num_registered == 1  # block 2 only: no placeholder under a hash
    assert manager.cached_prefix(_request_of(range(1, 17), "twin")) == []  # no chain from block 0


def test_a_registered_block_given_back_stays_cached_until_it_is_reused():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, window=5)
    request = _request_of(range(1, 17), "r")
    manager.allocate(request)
    request.num_computed_tokens = 12
    manager.register_computed(request)
    dropped = request.block_table[:2]
    manager.drop_out_of_window(request)
    assert manager.num_free_blocks == 8 - 4 + 2  # evictable: free, and their K/V still right
    assert manager.cached_prefix(_request_of(range(1, 17), "twin"))[:2] == dropped
    manager.allocate_blocks(manager.num_free_blocks)  # never-cached blocks first, then the evictable ones
    assert manager.cached_prefix(_request_of(range(1, 17), "twin")) == []  # forgotten as they were reused


def test_the_most_blocks_held_is_the_windows():
    assert [max_blocks_held(n, 4, 7) for n in (1, 4, 8, 9, 100)] == [1, 1, 2, 3, 3]
    assert max_blocks_held(100, 4, None) == 25
    assert BlockManager(num_blocks=4, block_size=16, window=4096).max_blocks_held(32768) == 257
