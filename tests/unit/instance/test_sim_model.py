"""The sim engine's model: the real engine around a latency model. Its tokens depend on the
KV cache, so a migration that moves the blocks continues exactly and one that loses them
does not; each step lasts what the latency model says."""

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.model_config import ModelConfig
from services.instance.engine.request import FinishReason
from services.instance.engine.sim_model import SimLatency, SimModel
from services.instance.engine.tokenizer import Tokenizer
from tests.unit.instance.test_migration_engine import GREEDY, PROMPT, SEEDED, Harness, assert_no_blocks_held, migrate

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4
NO_LATENCY = SimLatency(step_ms=0.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0)


@pytest.fixture(scope="module")
def sim(tiny_model_dir) -> tuple[ModelConfig, Tokenizer]:
    return ModelConfig.from_dir(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def make_engine(sim) -> Iterator[Callable[..., LLMEngine]]:
    caches: list[KvCache] = []

    def make(num_blocks: int = 64, dtype: torch.dtype = torch.float32, enable_prefix_caching: bool = True,
             window: int | None = None) -> LLMEngine:
        config, tokenizer = sim
        if window is not None:  # a sliding window on every layer
            config = replace(config, layer_windows=(window,) * config.num_hidden_layers)
        geometry = KvGeometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, BLOCK_SIZE,
                              num_blocks, dtype)
        cache = KvCache.create(f"ferry-kv-test-sim-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry)
        caches.append(cache)
        engine_config = EngineConfig(num_blocks=num_blocks, max_model_len=256, block_size=BLOCK_SIZE,
                                     max_num_seqs=8, max_num_batched_tokens=256,
                                     enable_prefix_caching=enable_prefix_caching)
        return LLMEngine(SimModel(config, NO_LATENCY), tokenizer, cache, engine_config)

    yield make
    for cache in caches:
        cache.close()
        cache.unlink()


def test_greedy_tokens_depend_on_the_prompt_only(make_engine):
    alone = make_engine().generate([PROMPT], GREEDY)[0]
    batched = make_engine().generate([[3, 1, 4], PROMPT, PROMPT[:5]], GREEDY)
    assert batched[1] == alone and batched[0] != alone and batched[2] != alone
    assert len(set(alone)) > len(alone) // 2  # not stuck on a few tokens


def test_with_a_window_on_every_layer_tokens_depend_on_the_window_only(make_engine):
    """The blocks behind the window go back (and are written by others) as with the torch engine, so the sim
    engine hashes the window's ids only: two prompts that differ only far behind it continue alike."""
    engine = make_engine(num_blocks=12, window=6)
    prompt = [(7 * i) % 200 + 3 for i in range(30)]
    first, second, other = engine.generate([prompt, [499, *prompt[1:]], [*prompt[:-1], 498]], GREEDY)
    assert first == second != other
    assert engine.block_manager.num_blocks_dropped > 0
    assert_no_blocks_held(engine)


def test_a_windowed_prompt_whose_first_chunk_outgrows_the_cache_finishes_with_length(make_engine):
    """An engine built straight from EngineConfig (no factory check that a window plus a step fits the
    cache): the window of a 60-token prompt fits 8 blocks, so it is taken, but its first chunk (the whole
    prompt, 15 blocks) never does. It finishes with LENGTH and the next request runs (without: it waited
    at the head of the queue forever, and the one behind it with it)."""
    engine = make_engine(num_blocks=8, window=6)
    engine.add_request("long", [(7 * i) % 200 + 3 for i in range(60)], GREEDY)
    engine.add_request("short", PROMPT[:5], GREEDY)
    reasons: dict[str, FinishReason] = {}
    num_tokens = {"long": 0, "short": 0}
    for _ in range(GREEDY.max_tokens + 10):  # bounded: without the fix no step finishes anything
        for output in engine.step():
            num_tokens[output.request_id] += len(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
    assert reasons == {"long": FinishReason.LENGTH, "short": FinishReason.LENGTH}
    assert num_tokens == {"long": 0, "short": GREEDY.max_tokens}
    assert_no_blocks_held(engine)


def test_cached_prefix_blocks_give_the_same_tokens_as_computing_them(make_engine):
    prompts = [PROMPT + [7, 7, 7], PROMPT + [9], PROMPT]
    cached, uncached = make_engine(), make_engine(enable_prefix_caching=False)
    got = [cached.generate([p], GREEDY)[0] for p in prompts]  # one at a time: each finds the last one's blocks
    assert got == [uncached.generate([p], GREEDY)[0] for p in prompts]
    assert cached.block_manager.prefix_cache.stats().num_hit_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_kv_dtype_holds_the_ids_exactly(make_engine, dtype):
    assert make_engine(dtype=dtype).generate([PROMPT], GREEDY) == make_engine().generate([PROMPT], GREEDY)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_migrated_with_its_blocks_continues_exactly(make_engine, sampling):
    reference = make_engine().generate([PROMPT], sampling)[0]
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, sampling)
    harness.run_until(a, "r", 9)
    migrate(a, b, "r")
    assert harness.finish(b, "r").token_ids == reference
    assert_no_blocks_held(a, b)


def test_migrated_without_its_blocks_goes_astray(make_engine, monkeypatch):
    """What makes the sim worth migrating: lost KV shows in the tokens, as with a real model."""
    import tests.unit.instance.test_migration_engine as harness_module
    reference = make_engine().generate([PROMPT], GREEDY)[0]
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, GREEDY)
    harness.run_until(a, "r", 9)
    monkeypatch.setattr(harness_module, "copy_blocks", lambda *args: None)  # the blocks never arrive
    migrate(a, b, "r")
    assert harness.finish(b, "r").token_ids != reference


def test_resumed_elsewhere_from_its_tokens_continues_exactly(make_engine):
    """A request re-dispatched after its instance died: prompt + the tokens so far, prefilled again."""
    reference = make_engine().generate([PROMPT], GREEDY)[0]
    resumed = make_engine().generate([PROMPT + reference[:7]], replace(GREEDY, max_tokens=len(reference) - 7))[0]
    assert reference[:7] + resumed == reference


def test_a_step_lasts_what_the_latency_model_says(sim):
    config, _ = sim
    latency = SimLatency(step_ms=5.0, prefill_ms_per_token=0.5, decode_ms_per_seq=2.0)
    slept: list[float] = []
    model = SimModel(config, latency, sleep=slept.append)
    kv = torch.zeros(config.num_hidden_layers, 2, 8, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    batch = ForwardBatch(  # one prefill of 6 tokens (blocks 1, 2), two decodes (blocks 3 and 4)
        input_ids=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 3, 4, 5, 2, 3]),
        slot_mapping=torch.tensor([4, 5, 6, 7, 8, 9, 14, 19]), query_lens=[6, 1, 1],
        context_lens=torch.tensor([6, 3, 4]), block_tables=torch.tensor([[1, 2], [3, 0], [4, 0]]))
    logits = model(batch, kv)
    assert logits.shape == (3, config.vocab_size) and logits.dtype == torch.float32
    assert latency.step_s(batch) == pytest.approx((5.0 + 6 * 0.5 + 2 * 2.0) / 1000)
    assert len(slept) == 1 and latency.step_s(batch) - 0.005 < slept[0] <= latency.step_s(batch)


def test_refuses_what_it_cannot_encode(sim):
    config, _ = sim
    with pytest.raises(ValueError, match="head_dim=2"):
        SimModel(replace(config, head_dim=2))
    with pytest.raises(ValueError, match="vocab_size=16777217"):
        SimModel(replace(config, vocab_size=2**24 + 1))
    with pytest.raises(ValueError, match="--sim-step-ms must be >= 0"):
        SimLatency(step_ms=-1.0)


def test_sampling_params_reach_the_sim_like_the_model(make_engine):
    """The sampler runs on the sim's logits as on a model's: a forbidding logit_bias wins over its peak."""
    greedy = make_engine().generate([PROMPT], GREEDY)[0]
    banned = greedy[0]
    biased = make_engine().generate([PROMPT], replace(GREEDY, logit_bias=((banned, -100.0),)))[0]
    assert biased[0] != banned



def test_prompt_logprobs_peak_where_greedy_would_go(make_engine):
    """Each prompt position's most likely token is the one greedy decoding of that prefix picks."""
    engine = make_engine()
    engine.add_request("r", PROMPT, replace(GREEDY, max_tokens=1, prompt_logprobs=1))
    (output,) = [o for _ in range(3) for o in engine.step()]
    entries = output.prompt_logprobs
    assert [e.token_id for e in entries] == PROMPT[1:]
    one_token = replace(GREEDY, max_tokens=1)
    for i, entry in enumerate(entries):
        assert list(entry.top_token_ids) == make_engine().generate([PROMPT[:i + 1]], one_token)[0]
