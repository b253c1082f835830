"""A model with a sliding window on every layer (a tiny random Mistral, window 7, 4-token blocks): the blocks behind
a request's window go back to the free pool, and greedy tokens still equal transformers' for sequences far longer
than the window, and than the whole KV cache; with prefix caching, preemptions and their recomputes, and live
migration (the source copies only the blocks it still holds, the destination gives back the rest unread)."""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from services.common.gen.ferry.v1 import common_pb2
from services.instance.config import InstanceRole
from services.instance.app import instance_record
from services.instance.engine.block_manager import max_blocks_held, num_blocks_out_of_window
from services.instance.engine.engine import LLMEngine
from services.instance.engine.factory import EngineSpec, LoadedEngine, build_engine, fitted_max_model_len
from services.instance.engine.request import SamplingParams
from services.instance.migration_attempt import MigrationInFlight
from services.instance.server import InstanceIdentity
from services.manager.domain import DispatchAsk, InstanceRecord
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.unit.instance.hf_families import hf_greedy, save_random_family_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WINDOW = 7
BLOCK_SIZE = 4
MAX_HELD = -(-WINDOW // BLOCK_SIZE) + 1  # 3: what a decoding request holds at most
CONTEXT = 512  # max_position_embeddings


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY_VOCAB_SIZE, (length,), generator=generator).tolist()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[pathlib.Path, object]:
    config = transformers.MistralConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, sliding_window=WINDOW, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False)
    return save_random_family_model(tmp_path_factory.mktemp("models") / "tiny-mistral-window", config)


@pytest.fixture
def make_engine(mistral) -> Iterator[Callable[..., LoadedEngine]]:
    loaded: list[LoadedEngine] = []

    def make(num_blocks: int, max_num_seqs: int = 4, max_num_batched_tokens: int = 16) -> LoadedEngine:
        loaded.append(build_engine(EngineSpec(
            mistral[0], kv_name=f"ferry-kv-test-window-{os.getpid()}-{uuid.uuid4().hex[:8]}", block_size=BLOCK_SIZE,
            num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)))
        return loaded[-1]

    yield make
    for each in loaded:
        each.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, outputs: dict[str, list[int]], after_step: Callable[[], None] = lambda: None) -> None:
    """Step until every request in `outputs` finished, adding their tokens."""
    unfinished = set(outputs)
    while unfinished:
        for output in engine.step():
            if output.request_id in outputs:
                outputs[output.request_id] += output.new_token_ids
                if output.finish_reason is not None:
                    unfinished.discard(output.request_id)
        after_step()


def held(engine: LLMEngine, request_id: str) -> int:
    request = engine._requests[request_id]
    return len(request.block_table) - request.num_dropped_blocks


def test_a_sequence_far_longer_than_the_window_and_the_cache_equals_transformers(mistral, make_engine):
    """100 tokens through a 40-token cache: decoding, the request holds its window's 3 blocks at most, and
    every block behind it went back (without: its context was cut to the cache, and it ended with LENGTH)."""
    loaded = make_engine(num_blocks=10)
    engine = loaded.engine
    assert loaded.max_model_len == CONTEXT  # not lowered to the 40 tokens the cache holds
    prompt, max_tokens = prompt_of(30, seed=1), 70
    engine.add_request("long", prompt, greedy(max_tokens))
    most_held: list[int] = []
    outputs = {"long": []}

    def check() -> None:
        request = engine._requests.get("long")
        if request is not None and request.num_output_tokens:  # decoding
            most_held.append(held(engine, "long"))
            assert engine.block_manager.num_used_blocks == held(engine, "long")
    run(engine, outputs, check)
    assert outputs["long"] == hf_greedy(mistral[1], prompt, max_tokens)
    assert max(most_held) == MAX_HELD
    # the last step computed position 98 (its logits gave token 100): every block wholly behind 98 - 7 went back
    assert engine.block_manager.num_blocks_dropped == num_blocks_out_of_window(98, BLOCK_SIZE, WINDOW) == 23
    assert engine.block_manager.num_free_blocks == 10


def test_prefix_caching_reads_given_back_blocks_only_while_they_are_cached(mistral, make_engine):
    """A request's blocks behind its window go back still cached (evictable): the same prompt again starts
    from them, and a prompt after the cache cycled does not; every token equals transformers'."""
    loaded = make_engine(num_blocks=32)
    engine = loaded.engine
    prompt = prompt_of(30, seed=2)
    expected = hf_greedy(mistral[1], prompt, 30)
    outputs = {"first": []}
    engine.add_request("first", prompt, greedy(30))
    run(engine, outputs)
    engine.add_request("again", prompt, greedy(30))
    outputs = {"again": []}
    run(engine, outputs)
    assert engine.prefix_cache_stats().num_hit_tokens == 28  # 7 full prompt blocks, the first 5 given back
    assert outputs["again"] == expected
    other = prompt_of(60, seed=3)
    engine.add_request("other", other, greedy(40))  # cycles every block of the cache
    outputs = {"other": []}
    run(engine, outputs)
    assert outputs["other"] == hf_greedy(mistral[1], other, 40)
    engine.add_request("third", prompt, greedy(30))
    outputs = {"third": []}
    run(engine, outputs)
    assert outputs["third"] == expected
    assert engine.block_manager.num_free_blocks == 32


def test_preempted_windowed_requests_recompute_exactly(mistral, make_engine):
    """Three long requests in a 7-block cache preempt each other; each recompute gives back its blocks
    behind the window again as it goes."""
    loaded = make_engine(num_blocks=7)
    engine = loaded.engine
    prompts = [prompt_of(20 + 3 * i, seed=10 + i) for i in range(3)]
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(40))
        outputs[f"r{i}"] = []
    run(engine, outputs)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(mistral[1], prompt, 40), i
    assert engine.block_manager.num_free_blocks == 7


def _migrate(src: LLMEngine, dst: LLMEngine, request_id: str, live_steps: int, outputs: dict[str, list[int]]) -> int:
    """The driver's copy plan (MigrationInFlight.pending): full blocks while the source decodes `live_steps`
    steps, the rest once suspended; copies only the blocks the source still holds. Returns the blocks copied."""
    migration_id = f"m-{uuid.uuid4().hex[:6]}"
    attempt = MigrationInFlight(migration_id, request_id, plan=None, peer=None, backend=None)
    num_copied = 0

    def copy(view, full_only: bool) -> None:
        nonlocal num_copied
        reserved = dst.reserve_blocks(migration_id, view.num_blocks)
        pending = attempt.pending(view, full_only=full_only)
        assert all(i >= view.num_dropped_blocks for i in pending)
        src_ids, dst_ids = [view.block_ids[i] for i in pending], [reserved[i] for i in pending]
        dst.kv_cache.tensor[:, :, dst_ids] = src.kv_cache.tensor[:, :, src_ids]
        attempt.copied.update((i, view.block_ids[i]) for i in pending)
        num_copied += len(pending)
    copy(src.migration_blocks(request_id), full_only=True)
    for _ in range(live_steps):
        for output in src.step():
            outputs[output.request_id] += output.new_token_ids
    view = src.suspend(request_id)
    assert view.num_dropped_blocks > 0
    copy(view, full_only=False)
    dst.import_request(migration_id, src.export_state(request_id), src_instance_id="src")
    src.release(request_id)
    return num_copied


@pytest.mark.parametrize("live_steps", [0, 9])
def test_a_migrated_windowed_request_equals_the_unmigrated_one(mistral, make_engine, live_steps):
    """Migrated after 20 tokens: the destination's cache is garbage where the source copied nothing, and it
    gives those blocks back unread and never caches them (a later request with the same prompt there computes
    it again); its tokens equal transformers' and it holds its window's blocks at most."""
    src, dst = make_engine(num_blocks=64).engine, make_engine(num_blocks=64).engine
    torch.manual_seed(5)
    dst.kv_cache.tensor.normal_(0.0, 3.0)
    prompt, max_tokens = prompt_of(30, seed=4), 40
    expected = hf_greedy(mistral[1], prompt, max_tokens)
    outputs = {"m": []}
    src.add_request("m", prompt, greedy(max_tokens))
    while len(outputs["m"]) < 20:
        for output in src.step():
            outputs["m"] += output.new_token_ids
    num_copied = _migrate(src, dst, "m", live_steps, outputs)
    request = dst._requests["m"]
    assert request.num_dropped_blocks == num_blocks_out_of_window(request.num_computed_tokens, BLOCK_SIZE, WINDOW)
    assert held(dst, "m") <= MAX_HELD
    assert num_copied < request.num_dropped_blocks  # far fewer than the table's blocks
    run(dst, outputs)
    assert outputs["m"] == expected
    assert src.block_manager.num_free_blocks == 64 and dst.block_manager.num_free_blocks == 64
    dst.add_request("again", prompt[:12], greedy(10))  # its last prompt token reads positions 0-11 through 2 layers
    again = {"again": []}
    run(dst, again)
    assert again["again"] == hf_greedy(mistral[1], prompt[:12], 10)
    assert dst.prefix_cache_stats().num_hit_tokens == 0


def test_admission_and_load_count_a_windowed_requests_window_only(make_engine):
    """A 200-token prompt in a 10-block cache is taken (it needs its window's blocks and a step's), and its
    load counts 3 blocks needed, not 50."""
    engine = make_engine(num_blocks=10).engine
    engine.add_request("long", prompt_of(200, seed=6), greedy(5))
    assert engine.load().num_blocks_needed_by_waiting == MAX_HELD == max_blocks_held(205, BLOCK_SIZE, WINDOW)
    outputs = {"long": []}
    run(engine, outputs)
    assert len(outputs["long"]) == 5


def test_the_served_context_is_lowered_only_where_the_window_does_not_fit_the_cache():
    # window 7 in 4-token blocks: 3 blocks, and a 16-token step 4 more: 28 tokens of KV
    assert fitted_max_model_len(512, is_explicit=True, kv_tokens=28, window_tokens=28) == 512
    assert fitted_max_model_len(512, is_explicit=False, kv_tokens=24, window_tokens=28) == 24
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        fitted_max_model_len(512, is_explicit=True, kv_tokens=24, window_tokens=28)
    assert fitted_max_model_len(512, is_explicit=False, kv_tokens=40, window_tokens=None) == 40


def test_a_cache_too_small_for_the_window_lowers_the_context(make_engine):
    assert make_engine(num_blocks=6).max_model_len == 24  # 24 tokens < 28: as without a window


def test_the_etcd_record_says_the_window_the_manager_counts_a_prompts_blocks_by(make_engine):
    """kv_window_tokens in the instance's etcd record: the manager's dispatch counts no more blocks for a prompt
    than the window's (services/manager/domain.py DispatchAsk.num_prompt_blocks), as the load report does."""
    loaded = make_engine(num_blocks=10)
    identity = InstanceIdentity("i-1", "127.0.0.1:1", InstanceRole.BOTH, "tiny-mistral", loaded.max_model_len,
                                common_pb2.KvGeometry())
    record = InstanceRecord.from_dict("i-1", instance_record(identity, loaded))
    assert record.kv_window_tokens == WINDOW
    assert DispatchAsk("r", num_prompt_tokens=200).num_prompt_blocks(record.block_size, record.kv_window_tokens) \
        == MAX_HELD == max_blocks_held(201, BLOCK_SIZE, WINDOW)
