"""Automatic prefix caching: the block manager's cached and evictable blocks, and the engine
reusing them with exactly the tokens it produces without a cache (transformers' for greedy)."""

import pytest

from services.common.errors import Internal, InvalidArgument
from services.instance.engine.block_manager import BlockManager
from services.instance.engine.request import FinishReason, SamplingParams
from tests.unit.instance.test_block_manager import make_request
from tests.unit.instance.test_engine import (  # noqa: F401 (fixtures)
    GREEDY,
    SEEDED,
    gqa,
    make_engine,
    random_prompts,
    reference_greedy,
    run,
    tiny,
)

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 4


# The block manager.

def computed(manager: BlockManager, num_prompt_tokens: int, name: str = "r", first_token: int = 1):
    """A request (prompt first_token, first_token + 1, ...) whose whole prompt was allocated, computed and
    registered."""
    request = make_request(num_prompt_tokens, name)
    request.prompt_token_ids = tuple(range(first_token, first_token + num_prompt_tokens))
    manager.start_from_cache(request, manager.cached_prefix(request))
    manager.allocate(request)
    request.num_computed_tokens = request.num_tokens
    manager.register_computed(request)
    return request


def test_full_blocks_stay_findable_after_free_and_count_as_free():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = computed(manager, 10)  # blocks 0, 1 full; block 2 partial
    blocks = list(first.block_table)
    manager.free(first)
    assert manager.num_free_blocks == 8
    assert manager.prefix_cache.num_evictable == 2 and manager.prefix_cache.num_registered == 2
    again = make_request(10, "again")
    assert manager.cached_prefix(again) == blocks[:2]


def test_a_block_registered_after_another_of_the_same_tokens_marks_where_its_own_cached_blocks_end():
    """Two requests that computed the same 10 tokens each in their own blocks (admitted in the same step): the
    second's blocks stay unfindable, and its cached prefix stops before its first one (its own rows may have
    other bits than the first's: a recompute must not take them), also after it started from the cache again."""
    manager = BlockManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    first, second = make_request(10, "a"), make_request(10, "b")
    for request in (first, second):
        manager.allocate(request)
        request.num_computed_tokens = request.num_tokens
    for request in (first, second):
        manager.register_computed(request)
    assert (first.first_foreign_block, second.first_foreign_block) == (None, 0)
    assert manager.cached_prefix(first) == first.block_table[:2] and manager.cached_prefix(second) == []
    manager.free(second)
    manager.start_from_cache(second, manager.cached_prefix(second))
    assert second.first_foreign_block == 0 and second.block_table == []


def test_a_hit_takes_idle_cached_blocks_out_of_the_free_count():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    manager.free(computed(manager, 9))
    request = make_request(9, "hit")
    cached = manager.cached_prefix(request)
    assert len(cached) == 2
    assert manager.num_blocks_to_admit(cached, 9) == 2 + 1  # two idle cached blocks + one new block
    manager.start_from_cache(request, cached)
    assert request.num_computed_tokens == 8 and manager.num_free_blocks == 6
    manager.allocate(request)
    assert manager.num_free_blocks == 5
    assert manager.prefix_cache.num_evictable == 0


def test_shared_blocks_count_holders_and_are_released_by_the_last():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = computed(manager, 9, "a")
    b = computed(manager, 9, "b")
    assert b.block_table[:2] == a.block_table[:2]
    assert [manager.ref_count(x) for x in a.block_table] == [2, 2, 1]
    manager.free(a)
    assert manager.prefix_cache.num_evictable == 0  # b still holds the shared blocks
    manager.free(b)
    assert manager.prefix_cache.num_evictable == 2 and manager.num_free_blocks == 8


def test_the_last_token_is_always_computed():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    manager.free(computed(manager, 8))  # two full blocks
    assert len(manager.cached_prefix(make_request(8, "same"))) == 1  # the second block holds the last token
    assert len(manager.cached_prefix(make_request(9, "longer"))) == 2


def test_uncached_free_blocks_go_first_then_the_least_recently_released():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    old = computed(manager, 9, "old")  # blocks 0, 1 registered, 2 partial
    other = computed(manager, 9, "other", first_token=50)  # blocks 3, 4 registered, 5 partial
    manager.free(old)
    manager.free(other)  # evictable, least recently released first: 1, 0 (tail first), then 4, 3
    assert manager.num_free_blocks == 8
    assert manager.allocate_blocks(4) == [2, 5, 6, 7]  # never-cached blocks first
    assert manager.allocate_blocks(1) == [1]  # then the tail of the least recently released sequence
    assert manager.prefix_cache.num_registered == 3
    assert manager.cached_prefix(make_request(9, "probe")) == [0]  # old's first block is still cached


def test_without_a_cache_nothing_is_registered():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.free(computed(manager, 9))
    assert manager.prefix_cache is None
    assert manager.cached_prefix(make_request(9, "again")) == []


def test_only_a_request_without_blocks_starts_from_cache():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    request = computed(manager, 9)
    with pytest.raises(Internal):
        manager.start_from_cache(request, [])


# The engine: same tokens with and without the cache.

SYSTEM = random_prompts([13], seed=21)[0]  # three full blocks and one token


def shared_prefix_arrivals(sampling: SamplingParams) -> tuple[dict[int, list[tuple]], dict[str, list[int]]]:
    """Requests sharing SYSTEM (some a prefix of another, one exactly block-aligned), arriving over steps."""
    suffixes = random_prompts([3, 8, 1, 6], seed=22)
    prompts = {f"s{i}": SYSTEM + suffix for i, suffix in enumerate(suffixes)}
    prompts["aligned"] = SYSTEM[:12]  # all three blocks cached: the last one is recomputed
    prompts["aligned-again"] = SYSTEM[:12]
    prompts["alone"] = random_prompts([9], seed=23)[0]
    order = ["s0", "aligned", "s1", "alone", "s2", "aligned-again", "s3"]
    arrivals: dict[int, list[tuple]] = {}
    for i, request_id in enumerate(order):
        arrivals.setdefault(2 * i, []).append((request_id, prompts[request_id], sampling))
    return arrivals, prompts


CONFIGS = {
    "roomy": dict(num_blocks=256, max_num_batched_tokens=512),
    "preempting": dict(num_blocks=16, max_num_batched_tokens=512),
    "chunked": dict(num_blocks=256, max_num_batched_tokens=5),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_with_shared_prefixes_matches_transformers(tiny, make_engine, config):  # noqa: F811
    engine = make_engine(tiny, block_size=BLOCK_SIZE, **CONFIGS[config])
    arrivals, prompts = shared_prefix_arrivals(GREEDY)
    collected = run(engine, arrivals)
    for request_id, prompt in prompts.items():
        got = collected[request_id]
        assert got.finish_reason is FinishReason.LENGTH
        assert got.token_ids == reference_greedy(tiny, prompt, GREEDY.max_tokens), request_id
    stats = engine.block_manager.prefix_cache.stats()
    assert stats.num_hit_tokens >= 12 * 4, stats  # s1..s3 and aligned-again reuse SYSTEM's blocks
    assert engine.block_manager.num_free_blocks == CONFIGS[config]["num_blocks"]


def test_seeded_sampling_is_the_same_with_and_without_the_cache(gqa, make_engine):  # noqa: F811
    arrivals, prompts = shared_prefix_arrivals(SEEDED)
    cached = run(make_engine(gqa, block_size=BLOCK_SIZE), arrivals)
    uncached = run(make_engine(gqa, block_size=BLOCK_SIZE, enable_prefix_caching=False), arrivals)
    assert {k: v.token_ids for k, v in cached.items()} == {k: v.token_ids for k, v in uncached.items()}


def test_requests_admitted_in_the_same_step_do_not_read_each_others_blocks(gqa, make_engine):  # noqa: F811
    engine = make_engine(gqa, block_size=BLOCK_SIZE)
    prompt = random_prompts([14], seed=24)[0]
    collected = run(engine, {0: [("a", prompt, GREEDY), ("b", prompt, GREEDY)]})
    assert engine.block_manager.prefix_cache.stats().num_hit_tokens == 0  # b's blocks were not computed yet
    assert collected["a"].token_ids == collected["b"].token_ids == reference_greedy(gqa, prompt, GREEDY.max_tokens)


def test_blocks_filled_while_decoding_are_cached_too(gqa, make_engine):  # noqa: F811
    engine = make_engine(gqa, block_size=BLOCK_SIZE)
    prompt = random_prompts([6], seed=25)[0]
    first = run(engine, {0: [("first", prompt, GREEDY)]})["first"].token_ids
    follow_up = prompt + first[:7]  # 13 tokens: its third block was filled by decoding
    got = run(engine, {0: [("follow-up", follow_up, GREEDY)]})["follow-up"].token_ids
    assert engine.block_manager.prefix_cache.stats().num_hit_tokens == 12
    assert got == reference_greedy(gqa, follow_up, GREEDY.max_tokens)


def test_eviction_under_pressure_keeps_tokens_exact_and_blocks_accounted(gqa, make_engine):  # noqa: F811
    engine = make_engine(gqa, block_size=BLOCK_SIZE, num_blocks=12, max_num_seqs=2)
    prompts = random_prompts([9, 10, 11, 9, 10], seed=26)
    prompts.append(prompts[0])  # by now its blocks were evicted, or some of them
    arrivals = {3 * i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(prompts)}
    collected = run(engine, arrivals)
    for i, prompt in enumerate(prompts):
        assert collected[f"r{i}"].token_ids == reference_greedy(gqa, prompt, GREEDY.max_tokens), i
    assert engine.block_manager.num_free_blocks == 12


def test_requests_share_cached_blocks_only_with_the_same_cache_salt(gqa, make_engine):  # noqa: F811
    engine = make_engine(gqa, block_size=BLOCK_SIZE)
    prompt = random_prompts([14], seed=27)[0]
    salted = {salt: SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, cache_salt=salt)
              for salt in ("", "tenant-a", "tenant-b")}
    outputs, hits = {}, {}
    for name, salt in (("plain", ""), ("a", "tenant-a"), ("b", "tenant-b"), ("a-again", "tenant-a")):
        before = engine.prefix_cache_stats().num_hit_tokens
        outputs[name] = run(engine, {0: [(name, prompt, salted[salt])]})[name].token_ids
        hits[name] = engine.prefix_cache_stats().num_hit_tokens - before
    assert hits == {"plain": 0, "a": 0, "b": 0, "a-again": 12}  # three full blocks, only under the same salt
    assert set(map(tuple, outputs.values())) == {tuple(reference_greedy(gqa, prompt, GREEDY.max_tokens))}


def test_a_cache_salt_longer_than_256_characters_is_refused(gqa, make_engine):  # noqa: F811
    with pytest.raises(InvalidArgument, match="cache_salt"):
        make_engine(gqa).add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, cache_salt="x" * 257))
