"""LLMEngine on tiny random Llamas: exact greedy parity with transformers under continuous
batching (staggered arrivals, preemption, chunked prefill), seeded sampling independent of
the batch, block accounting, resume, and every way a request finishes."""

import json
import os
import random
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import llguidance
import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from services.common.errors import InvalidArgument, ResourceExhausted
from services.instance.engine import attention
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.step_output import StepOutput
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.model import LlamaModel, load_model
from services.instance.engine.request import FinishReason, SamplingParams
from services.instance.engine.tokenizer import Tokenizer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

pytestmark = pytest.mark.timeout(120)

SHAPES = ("mha-untied", "gqa-tied")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10, ignore_eos=True)
GUIDED = replace(SEEDED, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z ]{100}"))


@dataclass(frozen=True)
class Tiny:
    model_dir: str
    model: LlamaModel
    tokenizer: Tokenizer


def load_tiny(model_dir) -> Tiny:
    return Tiny(str(model_dir), load_model(model_dir), Tokenizer.from_dir(model_dir))


@pytest.fixture(scope="module", params=SHAPES)
def tiny(request) -> Tiny:
    fixture = {"mha-untied": "tiny_mha_model_dir", "gqa-tied": "tiny_model_dir"}[request.param]
    return load_tiny(request.getfixturevalue(fixture))


@pytest.fixture(scope="module")
def gqa(tiny_model_dir) -> Tiny:
    return load_tiny(tiny_model_dir)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., LLMEngine]]:
    caches: list[KvCache] = []

    def make(tiny: Tiny, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 512, max_model_len: int = 1024,
             enable_prefix_caching: bool = True, priority_headroom_blocks: int = 0,
             max_num_waiting: int = 0, prefill_chunk_tokens: int = 0) -> LLMEngine:
        c = tiny.model.config
        geometry = KvGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, num_blocks,
                              torch.float32)
        cache = KvCache.create(f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry)
        caches.append(cache)
        config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              priority_headroom_blocks=priority_headroom_blocks, max_num_waiting=max_num_waiting,
                              prefill_chunk_tokens=prefill_chunk_tokens)
        return LLMEngine(tiny.model, tiny.tokenizer, cache, config)

    yield make
    for cache in caches:
        cache.close()
        cache.unlink()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


_reference_cache: dict[tuple, list[int]] = {}
_hf_models: dict[str, LlamaForCausalLM] = {}


def reference_greedy(tiny: Tiny, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy `generate` (eos ignored), cached."""
    key = (tiny.model_dir, tuple(prompt), max_tokens)
    if key not in _reference_cache:
        if tiny.model_dir not in _hf_models:
            _hf_models[tiny.model_dir] = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32)
        hf = _hf_models[tiny.model_dir]
        config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _reference_cache[key] = out[0, len(prompt):].tolist()
    return _reference_cache[key]


def continuation(tokenizer: Tokenizer, prompt: list[int], token_ids: list[int]) -> str:
    """The text `token_ids` add after the prompt (what the engine streams)."""
    return tokenizer.decode(prompt + token_ids)[len(tokenizer.decode(prompt)):]


def text_prompt(tiny: Tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text)


@dataclass
class Collected:
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    first_index: int | None = None
    logprobs: list = field(default_factory=list)  # with run(..., logprobs=True)


def run(engine: LLMEngine, arrivals: dict[int, list[tuple]], abort_at: dict[int, list[str]] | None = None,
        max_steps: int = 2000, logprobs: bool = False) -> dict[str, Collected]:
    """Step until done; `arrivals[step]` are add_request argument tuples added before that step."""
    abort_at = abort_at or {}
    collected: dict[str, Collected] = {}
    for step in range(max_steps):
        for args in arrivals.get(step, []):
            engine.add_request(*args[:3], **(args[3] if len(args) > 3 else {}))
            collected[args[0]] = Collected([])
        for request_id in abort_at.get(step, []):
            engine.abort(request_id)
            collected[request_id].finish_reason = FinishReason.ABORT
        if step > max(arrivals) and not engine.has_unfinished():
            return collected
        for output in engine.step():
            add_output(collected[output.request_id], output)
            if logprobs:
                collected[output.request_id].logprobs.extend(output.logprobs or ())
    raise AssertionError("engine did not finish")


def add_output(c: Collected, output: StepOutput) -> None:
    assert c.finish_reason is None, "output after the finish"
    if c.first_index is None:
        c.first_index = output.token_index
    assert output.token_index == c.first_index + len(c.token_ids), "token indices must be contiguous"
    c.token_ids += output.new_token_ids
    c.text += output.text
    c.finish_reason = output.finish_reason


# (1) Greedy parity with transformers under continuous batching.

PROMPT_LENGTHS = [3, 17, 9, 25, 1, 12]
CONFIGS = {
    "roomy": dict(num_blocks=256, max_num_batched_tokens=512),
    "preempting": dict(num_blocks=14, max_num_batched_tokens=512),  # 56 token slots for 6 requests
    "chunked": dict(num_blocks=256, max_num_batched_tokens=5),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_matches_transformers_with_staggered_arrivals(tiny, make_engine, config):
    engine = make_engine(tiny, **CONFIGS[config])
    prompts = random_prompts(PROMPT_LENGTHS)
    arrivals: dict[int, list[tuple]] = {0: [], 2: [], 5: []}
    for i, prompt in enumerate(prompts):
        arrivals[(0, 2, 5)[i % 3]].append((f"r{i}", prompt, GREEDY))
    collected = run(engine, arrivals)
    for i, prompt in enumerate(prompts):
        got = collected[f"r{i}"]
        assert got.first_index == 0 and got.finish_reason is FinishReason.LENGTH
        assert got.token_ids == reference_greedy(tiny, prompt, GREEDY.max_tokens), f"r{i} ({len(prompt)} tokens)"
    if config == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == CONFIGS[config]["num_blocks"]


def test_generate_convenience(gqa, make_engine):
    prompts = random_prompts([4, 11])
    outputs = make_engine(gqa).generate(prompts, GREEDY)
    assert outputs == [reference_greedy(gqa, p, GREEDY.max_tokens) for p in prompts]


def test_generate_takes_one_sampling_per_prompt(gqa, make_engine):
    prompts = random_prompts([4, 11, 7])
    budgets = [3, GREEDY.max_tokens, 1]
    engine = make_engine(gqa)
    outputs = engine.generate(prompts, [replace(GREEDY, max_tokens=m) for m in budgets])
    assert outputs == [reference_greedy(gqa, p, m) for p, m in zip(prompts, budgets)]
    with pytest.raises(InvalidArgument, match="2 sampling params for 3 prompts"):
        engine.generate(prompts, [GREEDY, GREEDY])


# (2) Seeded sampling ignores what else is in the batch.

def test_seeded_sampling_alone_equals_inside_a_busy_batch(gqa, make_engine):
    prompt = random_prompts([13], seed=5)[0]
    alone = run(make_engine(gqa), {0: [("x", prompt, SEEDED)]})["x"].token_ids
    others = random_prompts([5, 30, 8, 2, 19], seed=6)
    busy = {
        0: [("a", others[0], GREEDY), ("b", others[1], SamplingParams(temperature=1.2, seed=1, max_tokens=20))],
        3: [("c", others[2], SEEDED), ("x", prompt, SEEDED), ("d", others[3], SamplingParams(temperature=0.5))],
        4: [("e", others[4], SamplingParams(temperature=0.7, top_k=5, max_tokens=30, ignore_eos=True))],
    }
    engine = make_engine(gqa, num_blocks=40, max_num_batched_tokens=16)
    collected = run(engine, busy)
    assert collected["x"].token_ids == alone
    assert collected["c"].token_ids != alone  # same seed, different prompt
    assert len(alone) == SEEDED.max_tokens


def test_logprobs_are_the_same_bits_alone_and_in_a_busy_batch(gqa, make_engine, monkeypatch):
    """Batch invariance, the ground of "a migrated request's tokens equal those of one never
    migrated": every step of a request gives the same logprobs, to the bit, alone and among
    others that come and go (so the rows in each matmul and the lengths each sequence's keys
    are padded to change), while its context passes from gathered attention to attention read
    in place (here from 48 keys on, in segments of 16; the busy engine's blocks are scattered
    among the others'). Before, the batch's row count changed MKL's sums and decode keys were
    padded to the longest in the step: bits differed from the first token on. Each watched prompt
    is prefilled beside a longer one, whose queries and keys no longer pad its own. (A prompt found
    in the prefix cache is not invariant: README.)"""
    monkeypatch.setattr(attention, "IN_PLACE_MIN_KEYS", 48)
    monkeypatch.setattr(attention, "SEGMENT_KEYS", 16)
    prompts = random_prompts([13, 21], seed=8)
    wanted = {"greedy": replace(GREEDY, max_tokens=60, logprobs=2),
              "seeded": replace(SEEDED, max_tokens=60, logprobs=2)}
    alone = {name: run(make_engine(gqa), {0: [(name, prompt, sampling)]}, logprobs=True)[name]
             for (name, sampling), prompt in zip(wanted.items(), prompts)}
    others = random_prompts([5, 8, 40, 2, 19, 33], seed=9)
    busy = {0: [("a", others[0], replace(GREEDY, max_tokens=70)),
                ("b", others[1], SamplingParams(temperature=1.2, seed=1, max_tokens=25))],
            2: [("greedy", prompts[0], wanted["greedy"]), ("c", others[2], replace(SEEDED, max_tokens=5))],
            5: [("seeded", prompts[1], wanted["seeded"]), ("d", others[3], replace(GREEDY, max_tokens=90)),
                ("f", others[5], replace(GREEDY, max_tokens=44))],
            9: [("e", others[4], replace(GREEDY, max_tokens=12))]}
    collected = run(make_engine(gqa), busy, logprobs=True)
    for name in wanted:
        assert collected[name].token_ids == alone[name].token_ids
        assert collected[name].logprobs == alone[name].logprobs, name


def test_a_long_prompt_prefilled_in_chunks_gives_the_same_bits_alone_and_in_a_busy_batch(gqa, make_engine):
    """Its chunks end at the same places whatever else the step holds (scheduler.py): alone, the
    step's budget would take 24 tokens at once, beside three decodes 21; before, the chunks
    followed the budget and the bits differed from the first token."""
    config = dict(max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=False)  # chunks of 8
    prompt = random_prompts([57], seed=12)[0]
    sampling = replace(GREEDY, max_tokens=20, logprobs=2)
    alone = run(make_engine(gqa, **config), {0: [("p", prompt, sampling)]}, logprobs=True)["p"]
    others = random_prompts([6, 9, 4], seed=13)
    busy = run(make_engine(gqa, **config), {0: [(f"o{i}", p, replace(GREEDY, max_tokens=30))
                                                for i, p in enumerate(others)],
                                            2: [("p", prompt, sampling)]}, logprobs=True)["p"]
    assert busy.token_ids == alone.token_ids and busy.logprobs == alone.logprobs


def test_unseeded_requests_differ_but_get_a_seed(gqa, make_engine):
    engine = make_engine(gqa)
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompt = random_prompts([6])[0]
    engine.add_request("u1", prompt, unseeded)
    engine.add_request("u2", prompt, unseeded)
    seeds = {r.request_id: r.seed for r in engine.scheduler.waiting}
    assert seeds["u1"] != seeds["u2"]


# (3) Block accounting with aborts.

def test_blocks_return_after_finish_and_abort(gqa, make_engine):
    engine = make_engine(gqa, num_blocks=30, max_num_seqs=3, max_num_batched_tokens=16)
    start = engine.block_manager.num_free_blocks
    prompts = random_prompts([10, 20, 7, 15, 3], seed=2)
    arrivals = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:3])],
                2: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[3:], start=3)]}
    collected = run(engine, arrivals, abort_at={3: ["r1", "r4"], 6: ["r0"]})
    assert {k: v.finish_reason for k, v in collected.items()} == {
        "r0": FinishReason.ABORT, "r1": FinishReason.ABORT, "r2": FinishReason.LENGTH,
        "r3": FinishReason.LENGTH, "r4": FinishReason.ABORT,
    }
    assert engine.block_manager.num_free_blocks == start
    assert engine.list_requests() == []
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, start)
    assert not engine.abort("r0") and not engine.abort("never-added")


def test_abort_frees_blocks_at_once_and_load_reports(gqa, make_engine):
    engine = make_engine(gqa, num_blocks=20, max_num_seqs=1)
    engine.add_request("a", list(range(1, 10)), GREEDY)
    engine.add_request("b", list(range(1, 30)), GREEDY)
    engine.step()
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.num_free_blocks) == (1, 1, 20 - 3)
    assert load.num_blocks_needed_by_waiting == 8
    assert load.freeness == pytest.approx((17 - 8) / 2)
    assert load.num_free_slots == 0  # the one slot runs "a", and "b" waits for it
    states = {r.request_id: (r.state, r.num_tokens) for r in engine.list_requests()}
    assert states == {"a": ("running", 10), "b": ("waiting", 29)}
    assert engine.abort("a")
    assert engine.block_manager.num_free_blocks == 20
    assert engine.abort("b") and engine.load().num_free_slots == 1


def test_high_priority_requests_keep_headroom_out_of_the_reported_freeness(gqa, make_engine):
    engine = make_engine(gqa, num_blocks=40, max_num_seqs=4, priority_headroom_blocks=5)
    engine.add_request("normal", list(range(1, 10)), GREEDY)
    engine.add_request("urgent", list(range(1, 10)), GREEDY, priority=2)
    engine.add_request("queued-urgent", list(range(1, 10)), GREEDY, priority=1)
    engine.add_request("negative", list(range(1, 10)), GREEDY, priority=-1)
    load = engine.load()
    assert load.num_headroom_blocks == 2 * 5
    assert load.freeness == pytest.approx((40 - load.num_blocks_needed_by_waiting - 10) / (load.num_running + 1))
    assert engine.abort("urgent") and engine.load().num_headroom_blocks == 5


# (4) Resume with tokens generated elsewhere.

@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, GUIDED], ids=["greedy", "seeded", "guided"])
def test_resumed_request_continues_exactly(gqa, make_engine, sampling):
    prompt = random_prompts([11], seed=3)[0]
    full = run(make_engine(gqa), {0: [("r", prompt, sampling)]})["r"]
    for k in (1, 4, 9):
        engine = make_engine(gqa, max_num_batched_tokens=6)
        arrivals = {0: [("other", random_prompts([7], seed=4)[0], SEEDED)],
                    1: [("r", prompt, sampling, {"resume_token_ids": full.token_ids[:k]})]}
        resumed = run(engine, arrivals)["r"]
        assert resumed.first_index == k
        assert resumed.token_ids == full.token_ids[k:]
        assert resumed.finish_reason is full.finish_reason


def test_a_resumed_or_preempted_request_goes_on_with_the_same_bits(gqa, make_engine):
    """Output tokens computed again attend one by one as their decode steps did (forward_batch.py), and the
    prompt is cut where it was: a resume after a failure, or a preemption's recompute, gives the same logprobs
    to the bit as a run that never stopped (before: the same tokens, other bits)."""
    config = dict(max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=False)  # chunks of 8
    prompt = random_prompts([29], seed=14)[0]
    sampling = replace(GREEDY, max_tokens=40, logprobs=2)
    full = run(make_engine(gqa, **config), {0: [("r", prompt, sampling)]}, logprobs=True)["r"]
    for k in (1, 9, 33):
        arrivals = {0: [("other", random_prompts([7], seed=15)[0], replace(SEEDED, max_tokens=30))],
                    1: [("r", prompt, sampling, {"resume_token_ids": full.token_ids[:k]})]}
        resumed = run(make_engine(gqa, **config), arrivals, logprobs=True)["r"]
        assert resumed.token_ids == full.token_ids[k:] and resumed.logprobs == full.logprobs[k:], k
    tight = make_engine(gqa, num_blocks=24, **config)  # 96 token slots for two 69-token requests: one is preempted
    got = run(tight, {0: [("s", random_prompts([29], seed=16)[0], sampling)], 1: [("r", prompt, sampling)]},
              logprobs=True)
    assert tight.scheduler.num_preemptions > 0  # of r, the later one
    assert got["r"].token_ids == full.token_ids and got["r"].logprobs == full.logprobs


ONE_TOKEN_PAST_CACHE = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True)


def lone_query_row_keeps_its_bits(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether this CPU's SDPA gives a prompt's last query row, attended alone over the cached keys (masked),
    the bits it gets as the last row of the whole prompt's causal attention. It depends on the CPU's
    kernels: one machine gave the same bits for 16k + 1 tokens with k even, this one for none (README:
    'Not invariant')."""
    generator = torch.Generator().manual_seed(0)
    num_keys = -(-num_tokens // 16) * 16  # gathered as whole blocks
    q = torch.randn(1, num_heads, num_tokens, head_dim, generator=generator)
    k, v = (torch.randn(1, num_kv_heads, num_keys, head_dim, generator=generator) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = (torch.arange(num_keys) < num_tokens)[None, None, None, :]
    lone = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, v, attn_mask=mask, enable_gqa=True)
    return torch.equal(whole[:, :, -1:], lone)


def one_token_prompt_chunks(engine: LLMEngine) -> list[bool]:
    """Records, for each forward that computes a one-token prompt chunk, whether it attends as a decode."""
    seen: list[bool] = []

    def record(_module, args) -> None:
        batch = args[0]
        chunks = batch.is_prompt_chunk or [False] * batch.num_seqs
        seen.extend(is_decode for n, is_chunk, is_decode in zip(batch.query_lens, chunks, batch.is_decode(),
                                                                strict=True) if n == 1 and is_chunk)
    engine.model.register_forward_pre_hook(record)
    return seen


def test_a_prompt_one_token_past_its_cached_blocks_attends_as_a_prefill(gqa, make_engine):
    """A prompt of 16k + 1 tokens whose full blocks are cached (the same prompt again, or a preempted request
    recomputing while its sibling keeps the prompt's blocks) computes its last token alone: that one-token chunk
    attends as a prefill, as it did within the whole prompt. Before, it took the decode path (other padding):
    the same tokens with other logprobs, seen black-box as an n=2 choice and a 113-token prompt under KV
    pressure differing from the same request run alone."""
    prompt = random_prompts([65], seed=14)[0]
    first, second = (replace(SEEDED, max_tokens=20, seed=seed) for seed in (1, 2))
    engine = make_engine(gqa, **ONE_TOKEN_PAST_CACHE)
    attends_as_decode = one_token_prompt_chunks(engine)
    run(engine, {0: [("a", prompt, first)], 30: [("b", prompt, second)]})
    assert attends_as_decode == [False]  # b's last prompt token, after a's 4 cached blocks


def test_a_prompt_one_token_past_its_cached_blocks_keeps_its_bits(gqa, make_engine):
    """The same, to the bit, where this CPU's attention gives a lone prompt row the bits it has within the
    whole prompt (lone_query_row_keeps_its_bits)."""
    config = gqa.model.config
    if not lone_query_row_keeps_its_bits(65, config.num_attention_heads, config.num_key_value_heads, config.head_dim):
        pytest.skip("this CPU's SDPA gives a 65-token prompt's last query row, attended alone, other bits "
                    "than within the whole prompt (README: 'Not invariant')")
    prompt = random_prompts([65], seed=14)[0]
    first, second = (replace(SEEDED, max_tokens=119, logprobs=1, top_k=0, seed=seed) for seed in (1, 2))
    alone = run(make_engine(gqa, **ONE_TOKEN_PAST_CACHE), {0: [("b", prompt, second)]}, logprobs=True)["b"]
    engine = make_engine(gqa, **ONE_TOKEN_PAST_CACHE)
    cached = run(engine, {0: [("a", prompt, first)], 200: [("b", prompt, second)]}, logprobs=True)["b"]
    assert cached.token_ids == alone.token_ids and cached.logprobs == alone.logprobs
    tight = make_engine(gqa, num_blocks=12, **ONE_TOKEN_PAST_CACHE)  # b is preempted; a keeps the 4 full blocks
    got = run(tight, {0: [("a", prompt, first), ("b", prompt, second)]}, logprobs=True)["b"]
    assert tight.scheduler.num_preemptions > 0
    assert got.token_ids == alone.token_ids and got.logprobs == alone.logprobs



@pytest.mark.parametrize("prompt_len, first_recomputed", [(65, 16), (49, 31)])
def test_a_preempted_request_recomputes_its_prompt_from_where_it_was_cut(gqa, make_engine, prompt_len,
                                                                        first_recomputed):
    """A preempted request whose first prompt blocks are still cached, but not the rest, recomputes its prompt
    from its chunk boundary, not from its last cached block: a chunk starting at another row gives its rows other
    bits (SDPA sums a prefill's rows in blocks of its own), also a one-token chunk (the prompt's last token after
    3 cached blocks, with 49 tokens). Before, the request went on with other logprobs from its first token after
    the preemption (index 16 of a 16k + 1-token prompt, self-preempted at its next block), seen black-box on
    a cluster with 24-block caches, with no migration."""
    config = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True)
    prompt = random_prompts([prompt_len], seed=14)[0]
    sampling = replace(GREEDY, max_tokens=60, logprobs=1)
    alone = run(make_engine(gqa, **config), {0: [("r", prompt, sampling)]}, logprobs=True)["r"]
    tight = make_engine(gqa, num_blocks=9, **config)  # r is preempted; s then evicts r's later prompt blocks
    got = run(tight, {0: [("s", random_prompts([33], seed=15)[0], sampling)], 1: [("r", prompt, sampling)]},
              logprobs=True)["r"]
    assert tight.scheduler.num_preemptions == 1
    assert got.token_ids == alone.token_ids
    assert got.logprobs[:first_recomputed] == alone.logprobs[:first_recomputed]
    assert got.logprobs == alone.logprobs


def test_a_preempted_request_first_computed_after_a_cached_prompt_starts_there_again(gqa, make_engine):
    """A request admitted after a sibling's cached prompt blocks computed only its prompt's last token; preempted
    while the sibling keeps those blocks, it starts there again, not at the prompt's chunk boundary, so it goes
    on with the bits it had (an 81-token prompt's last token alone has other bits than within the whole prompt).
    Seen black-box as an n=2 choice drifting from output token 16."""
    config = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True)
    prompt = random_prompts([81], seed=14)[0]
    first, second = (replace(SEEDED, max_tokens=60, logprobs=1, top_k=0, seed=seed) for seed in (1, 2))
    arrivals = {0: [("a", prompt, first)], 2: [("b", prompt, second)]}
    roomy = run(make_engine(gqa, **config), arrivals, logprobs=True)["b"]
    tight = make_engine(gqa, num_blocks=9, **config)  # b is preempted; a keeps the prompt's 5 full blocks
    got = run(tight, arrivals, logprobs=True)["b"]
    assert tight.scheduler.num_preemptions > 0
    assert got.token_ids == roomy.token_ids and got.logprobs == roomy.logprobs


@pytest.mark.parametrize("prompt_len, num_blocks", [(49, 7), (145, 13)])
def test_a_request_first_computed_after_a_cached_prompt_recomputes_it_cut_there_once_those_blocks_are_gone(
        gqa, make_engine, prompt_len, num_blocks):
    """A request admitted after a sibling's cached prompt blocks (an n=2 choice) computed only its prompt's last
    token; preempted, and readmitted once a later request evicted those blocks, it computes its prompt again from
    its chunk boundary, cut where it first started too: the last token alone again, as it was. Before, that token
    was computed within the whole prompt (other bits for 16k + 1 tokens with k odd): the same tokens, other
    logprobs from the first one after the preemption, as an n=2 choice of a 145-token prompt showed from output
    token 46 in a black-box cluster run under KV pressure."""
    config = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True)
    prompt, other = random_prompts([prompt_len, 40], seed=14)
    first, second = (replace(SEEDED, max_tokens=60, logprobs=1, top_k=0, seed=seed) for seed in (1, 2))
    arrivals = {0: [("a", prompt, first)], 2: [("b", prompt, second)]}
    roomy = run(make_engine(gqa, **config), arrivals, logprobs=True)["b"]
    tight = make_engine(gqa, num_blocks=num_blocks, **config)  # b is preempted; c evicts a's prompt blocks
    arrivals[6] = [("c", other, replace(GREEDY, max_tokens=120), {"priority": 1})]
    got = run(tight, arrivals, logprobs=True)["b"]
    assert tight.scheduler.num_preemptions > 0
    assert got.token_ids == roomy.token_ids and got.logprobs == roomy.logprobs


def test_a_request_preempted_during_its_prefill_restarts_where_its_prompt_was_cut(gqa, make_engine):
    """b starts after the 64 tokens of a's prompt a has computed (32-token chunks) and is preempted during its
    own prefill, before its first token; readmitted once a's whole prompt is cached, it restarts at a chunk
    boundary (96), not at a's last cached block: its prompt's last token alone has other bits than within its
    chunk [96, 113). Before, it went on with other logprobs from its first token (an engine-level sweep of
    n=2 choices under KV pressure found it)."""
    config = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True, prefill_chunk_tokens=32)
    prompt = random_prompts([113], seed=14)[0]
    first, second = (replace(SEEDED, max_tokens=40, logprobs=1, top_k=0, seed=seed) for seed in (1, 2))
    arrivals = {0: [("a", prompt, first)], 2: [("b", prompt, second)]}
    roomy = run(make_engine(gqa, **config), arrivals, logprobs=True)["b"]
    tight = make_engine(gqa, num_blocks=10, **config)  # b preempts itself when a takes the blocks for [96, 113)
    got = run(tight, arrivals, logprobs=True)["b"]
    assert tight.scheduler.num_preemptions > 0
    assert got.token_ids == roomy.token_ids and got.logprobs == roomy.logprobs


@pytest.mark.parametrize("num_blocks", [8, 9, 10])
def test_a_greedy_choice_recomputed_does_not_take_its_siblings_blocks_of_the_same_tokens(gqa, make_engine,
                                                                                        num_blocks):
    """Greedy n=2 choices of a 49-token prompt generate the same tokens, so their blocks have the same hashes; b,
    first computed after a's cached prompt, has other bits in them (its last prompt token alone). Preempted, b
    restarts from none of a's blocks past its own first start, so it goes on with its own bits. Before, it took
    a's blocks of its prompt's end and first output tokens: other logprobs from its first token after the
    preemption (an engine-level sweep of n=2 choices under KV pressure found it)."""
    config = dict(block_size=16, max_num_seqs=4, enable_prefix_caching=True)
    prompt = random_prompts([49], seed=14)[0]
    sampling = replace(GREEDY, max_tokens=60, logprobs=1)
    arrivals = {0: [("a", prompt, sampling)], 2: [("b", prompt, sampling)]}
    roomy = run(make_engine(gqa, **config), arrivals, logprobs=True)["b"]
    tight = make_engine(gqa, num_blocks=num_blocks, **config)
    got = run(tight, arrivals, logprobs=True)["b"]
    assert tight.scheduler.num_preemptions > 0
    assert got.token_ids == roomy.token_ids and got.logprobs == roomy.logprobs


def test_a_resume_goes_on_after_the_text_the_client_has(gqa, make_engine):
    """The client may hold less text than its tokens make (a possible stop string held back):
    with resume_text the resumed stream sends the rest, so the text joins up exactly."""
    prompt = random_prompts([9], seed=5)[0]
    sampling = replace(GREEDY, max_tokens=14, stop=["zz zz zz zz"])  # 10 characters held back
    full = run(make_engine(gqa), {0: [("r", prompt, sampling)]})["r"]
    k = 8
    sent = make_engine(gqa).tokenizer.decode(full.token_ids[:k])[:-10]
    resumed = run(make_engine(gqa), {0: [("r", prompt, sampling,
                                         {"resume_token_ids": full.token_ids[:k], "resume_text": sent})]})["r"]
    assert resumed.token_ids == full.token_ids[k:] and sent + resumed.text == full.text
    with pytest.raises(InvalidArgument, match="resume_text"):
        make_engine(gqa).add_request("r", prompt, sampling, resume_token_ids=full.token_ids[:k],
                                     resume_text="not this text")


# (5) How requests finish.

def greedy_tokens(tiny: Tiny, make_engine, prompt: list[int], max_tokens: int = 12) -> Collected:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return run(make_engine(tiny), {0: [("probe", prompt, sampling)]})["probe"]


def test_max_tokens_and_text(gqa, make_engine):
    prompt = text_prompt(gqa, "Once upon a time")
    got = greedy_tokens(gqa, make_engine, prompt, max_tokens=20)
    assert len(got.token_ids) == 20 and got.finish_reason is FinishReason.LENGTH
    assert got.text == continuation(gqa.tokenizer, prompt, got.token_ids)


def test_max_model_len_finishes_with_length(gqa, make_engine):
    prompt = random_prompts([6], seed=8)[0]
    engine = make_engine(gqa, max_model_len=9)
    got = run(engine, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=50))]})["r"]
    assert len(got.token_ids) == 3 and got.finish_reason is FinishReason.LENGTH


def test_a_resume_that_fills_the_context_is_refused(gqa, make_engine):
    """The request that never stopped ended (LENGTH) as its tokens filled max_model_len: a resume of all of them
    has nothing left to generate, as one past max_tokens, and is refused naming the field (before: it made one
    token past the context). A prompt alone that fills the context still makes its one token."""
    prompt = random_prompts([6], seed=8)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=50)
    full = run(make_engine(gqa, max_model_len=9), {0: [("r", prompt, sampling)]})["r"]
    resumed = run(make_engine(gqa, max_model_len=9),
                  {0: [("r", prompt, sampling, {"resume_token_ids": full.token_ids[:2]})]})["r"]
    assert resumed.token_ids == full.token_ids[2:] and resumed.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidArgument, match=r"^resume_token_ids: .*\(9\) fill the model's context of 9"):
        make_engine(gqa, max_model_len=9).add_request("r", prompt, sampling, resume_token_ids=full.token_ids)
    whole = run(make_engine(gqa, max_model_len=6), {0: [("r", prompt, sampling)]})["r"]
    assert len(whole.token_ids) == 1 and whole.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_and_eos(gqa, make_engine):
    prompt = text_prompt(gqa, "The capital of France is")
    full = greedy_tokens(gqa, make_engine, prompt)
    stop_at = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    stop_token = full.token_ids[stop_at]

    by_id = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_token,))
    got = run(make_engine(gqa), {0: [("r", prompt, by_id)]})["r"]
    assert got.token_ids == full.token_ids[:stop_at + 1] and got.finish_reason is FinishReason.STOP
    assert got.text == continuation(gqa.tokenizer, prompt, full.token_ids[:stop_at])  # stop token's text left out

    engine = make_engine(gqa)
    engine.eos_token_ids = frozenset({stop_token})  # pretend the model's eos is this token
    got = run(engine, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=12))]})["r"]
    assert got.token_ids == full.token_ids[:stop_at + 1] and got.finish_reason is FinishReason.STOP
    engine = make_engine(gqa)
    engine.eos_token_ids = frozenset({stop_token})
    got = run(engine, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]})["r"]
    assert got.token_ids == full.token_ids and got.finish_reason is FinishReason.LENGTH


def test_stop_string_spanning_tokens(gqa, make_engine):
    prompt = text_prompt(gqa, "def add(a, b):")
    full = greedy_tokens(gqa, make_engine, prompt, max_tokens=30)
    assert full.text == continuation(gqa.tokenizer, prompt, full.token_ids)
    pieces = [continuation(gqa.tokenizer, prompt, full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]

    def is_clean(i: int) -> bool:  # the text of the first i tokens is whole characters
        return full.text.startswith(pieces[i]) and not pieces[i].endswith("\ufffd")

    def spans_two_tokens(i: int) -> bool:  # last char of token i-2's text + first char of token i-1's
        b = len(pieces[i - 1])
        return (all(is_clean(j) for j in (i - 2, i - 1, i)) and len(pieces[i - 2]) < b < len(pieces[i])
                and full.text.index(full.text[b - 1:b + 1]) == b - 1)

    i = next(i for i in range(2, len(full.token_ids) + 1) if spans_two_tokens(i))
    b = len(pieces[i - 1])
    sampling = SamplingParams(temperature=0.0, max_tokens=30, stop=(full.text[b - 1:b + 1],))
    got = run(make_engine(gqa), {0: [("r", prompt, sampling)]})["r"]
    assert got.finish_reason is FinishReason.STOP
    assert got.token_ids == full.token_ids[:i]  # the token that completed the stop string is kept
    assert got.text == full.text[:b - 1]  # the text ends before the stop string


def test_invalid_requests_name_the_field(gqa, make_engine):
    engine = make_engine(gqa, num_blocks=8, max_model_len=100)
    cases = [
        ([], GREEDY, {}, "prompt"),
        (list(range(1, 102)), GREEDY, {}, "max_model_len"),
        ([1, 2], SamplingParams(max_tokens=0), {}, "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), {}, "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), {}, "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), {}, "top_p"),
        ([1, 2], SamplingParams(top_k=-1), {}, "top_k"),
        ([1, 2], SamplingParams(logprobs=21), {}, "logprobs"),
        ([1, 10**6], GREEDY, {}, "prompt_token_ids"),
        ([1, 2], SamplingParams(max_tokens=3), {"resume_token_ids": [4, 5, 6]}, "resume_token_ids"),
        ([1, 2], SamplingParams(presence_penalty=2.5), {}, "presence_penalty"),
        ([1, 2], SamplingParams(frequency_penalty=-3.0), {}, "frequency_penalty"),
        ([1, 2], SamplingParams(logit_bias=((1, 150.0),)), {}, "logit_bias"),
        ([1, 2], SamplingParams(repetition_penalty=0.0), {}, "repetition_penalty"),
        ([1, 2], SamplingParams(repetition_penalty=2.5), {}, "repetition_penalty"),
        ([1, 2], SamplingParams(min_p=1.5), {}, "min_p"),
        ([1, 2], SamplingParams(logit_bias=((10**6, 1.0),)), {}, "logit_bias: token id 1000000 is outside"),
        ([1, 2], SamplingParams(stop_token_ids=(3, 10**6)), {}, "stop_token_ids: token id 1000000 is outside"),
    ]
    for prompt, sampling, kwargs, named in cases:
        with pytest.raises(InvalidArgument, match=named):
            engine.add_request("r", prompt, sampling, **kwargs)
    with pytest.raises(ResourceExhausted, match="num-blocks"):
        engine.add_request("r", list(range(1, 40)), GREEDY)  # 39 tokens > 8 blocks of 4
    engine.add_request("r", [1, 2], GREEDY)
    with pytest.raises(InvalidArgument, match="request_id"):
        engine.add_request("r", [1, 2], GREEDY)
    assert engine.block_manager.num_free_blocks == 8


def test_the_waiting_queue_is_bounded_for_new_requests_only(gqa, make_engine):
    engine = make_engine(gqa, max_num_seqs=1, max_num_waiting=2)
    engine.add_request("a", [1, 2], GREEDY)
    engine.add_request("b", [1, 2], GREEDY)
    with pytest.raises(ResourceExhausted, match="2 requests are already waiting to start.*batch slot or KV blocks; --max-waiting-requests 2"):
        engine.add_request("c", [1, 2], GREEDY)
    engine.add_request("resumed", [1, 2], replace(GREEDY, max_tokens=8), resume_token_ids=[3])  # a stream under way
    engine.step()  # "a" runs; "b" and "resumed" wait
    with pytest.raises(ResourceExhausted):
        engine.add_request("c", [1, 2], GREEDY)
    engine.abort("b")
    engine.add_request("c", [1, 2], GREEDY)


def test_logprobs_in_outputs(gqa, make_engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
    engine = make_engine(gqa)
    engine.add_request("r", [3, 4, 5], sampling)
    outputs = [o for _ in range(3) for o in engine.step()]
    for output in outputs:
        (entry,) = output.logprobs
        assert entry.token_id == output.new_token_ids[0] == entry.top_token_ids[0]
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0


# Prompt logprobs (completions echo + logprobs): every prompt token's, equal to transformers'.

def reference_prompt_logprobs(tiny: Tiny, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution transformers gives prompt token i + 1."""
    if tiny.model_dir not in _hf_models:
        _hf_models[tiny.model_dir] = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = _hf_models[tiny.model_dir](torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def check_prompt_logprobs(tiny: Tiny, prompt: list[int], entries, num_top: int) -> None:
    reference = reference_prompt_logprobs(tiny, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    for row, (entry, token_id) in enumerate(zip(entries, prompt[1:])):
        assert entry.logprob == pytest.approx(reference[row, token_id].item(), abs=1e-4)
        assert entry.rank == int((reference[row] > reference[row, token_id] + 1e-5).sum()) + 1
        top_values, top_ids = reference[row].topk(num_top)
        assert list(entry.top_logprobs) == pytest.approx(top_values.tolist(), abs=1e-4)
        assert len(entry.top_token_ids) == num_top


@pytest.mark.parametrize("config", [*sorted(CONFIGS), "one_token_chunks"])
def test_prompt_logprobs_match_transformers(gqa, make_engine, config):
    """Chunked prefills (down to one token a step), preemptions and a busy batch: each request's prompt
    logprobs come once, with output token 0, and equal transformers' full forward."""
    engine = make_engine(gqa, **CONFIGS.get(config, dict(num_blocks=256, max_num_batched_tokens=1)))
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    engine.add_request("warm", prompts[3], GREEDY)  # caches prompt 3's blocks: its prompt logprobs must not use them
    while engine.has_unfinished():
        engine.step()
    sampling = replace(GREEDY, max_tokens=4, prompt_logprobs=3)
    arrivals: dict[int, list[tuple]] = {0: [], 1: [], 3: []}
    for i, prompt in enumerate(prompts):
        arrivals[(0, 1, 3)[i % 3]].append((f"r{i}", prompt, sampling))
    sent: dict[str, list] = {}
    for step in range(1000):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            assert (output.prompt_logprobs is not None) == (output.token_index == 0 and bool(output.new_token_ids))
            if output.prompt_logprobs is not None:
                sent[output.request_id] = list(output.prompt_logprobs)
        if step > 3 and not engine.has_unfinished():
            break
    assert sorted(sent) == sorted(f"r{i}" for i in range(len(prompts)))
    for i, prompt in enumerate(prompts):
        check_prompt_logprobs(gqa, prompt, sent[f"r{i}"], num_top=3)
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks


def test_prompt_logprobs_not_for_resumed_requests(gqa, make_engine):
    """A resumed request's client already has them (they came with token 0): none again."""
    engine = make_engine(gqa)
    prompt = random_prompts([9])[0]
    engine.add_request("r", prompt, replace(GREEDY, prompt_logprobs=0), resume_token_ids=[5, 6])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs and all(o.prompt_logprobs is None for o in outputs)
    engine.add_request("one", [7], replace(GREEDY, prompt_logprobs=0))  # a one-token prompt has none to give
    first = next(o for o in engine.step() if o.request_id == "one")
    assert first.prompt_logprobs == ()


def test_a_stop_string_in_raw_bytes_held_back_to_the_end_stops_the_request(gqa, make_engine):
    """A run of SentencePiece <0xNN> tokens is held back until a token that is no byte ends it; one that
    runs to max_tokens comes out at the end. Before, that text was not looked through for stop strings:
    the request ended LENGTH with the stop string in its text."""
    backend = BackendTokenizer(models.WordLevel({**{f"<0x{b:02X}>": b for b in range(256)}, "<s>": 256}, "<s>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    engine = make_engine(gqa)
    engine.tokenizer = Tokenizer(backend)
    prompt = text_prompt(gqa, "Hello")
    always_a = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((0x41, 100.0),))  # <0x41>: "A"
    got = run(engine, {0: [("plain", prompt, always_a), ("stop", prompt, replace(always_a, stop=("AA",)))]})
    assert got["plain"].text == "AAAAAA" and got["plain"].finish_reason is FinishReason.LENGTH
    assert got["stop"].token_ids == [0x41] * 6
    assert got["stop"].text == "" and got["stop"].finish_reason is FinishReason.STOP


def test_raw_bytes_after_a_prompt_ending_in_raw_byte_characters_decode_as_the_whole_text_does(gqa, make_engine):
    """A prompt whose last 4 tokens start inside a character spelled in <0xNN> tokens ("北京": E5 8C 97,
    E4 BA AC): the detokenizer's context began at 0x97, a run the decoder turned into U+FFFD per byte,
    and output bytes continuing it came out U+FFFD too ("A" became "\ufffd", a Chinese answer garbled)."""
    backend = BackendTokenizer(models.WordLevel({**{f"<0x{b:02X}>": b for b in range(256)}, "<s>": 256}, "<s>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    engine = make_engine(gqa)
    engine.tokenizer = Tokenizer(backend)
    prompt = list("Hi北京".encode())  # a byte's id is its value
    always_a = SamplingParams(temperature=0.0, max_tokens=3, logit_bias=((0x41, 100.0),))  # <0x41>: "A"
    got = run(engine, {0: [("a", prompt, always_a)]})
    assert got["a"].token_ids == [0x41] * 3
    assert backend.decode(prompt + got["a"].token_ids) == "Hi北京AAA"
    assert got["a"].text == "AAA"


def test_a_request_too_long_for_the_whole_cache_cut_at_a_stop_string_in_held_back_bytes_finishes_stop(
        gqa, make_engine):
    """The scheduler ends a request that outgrew the whole cache; the raw bytes held back to then are
    looked through for stop strings as at max_tokens, and a cut there finishes it STOP, not LENGTH."""
    backend = BackendTokenizer(models.WordLevel({**{f"<0x{b:02X}>": b for b in range(256)}, "<s>": 256}, "<s>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    engine = make_engine(gqa, num_blocks=4, block_size=4)  # 16 tokens in all
    engine.tokenizer = Tokenizer(backend)
    prompt = text_prompt(gqa, "Hello")
    always_a = SamplingParams(temperature=0.0, max_tokens=64, logit_bias=((0x41, 100.0),))  # <0x41>: "A"
    got = run(engine, {0: [("plain", prompt, always_a)]})
    assert got["plain"].finish_reason is FinishReason.LENGTH and len(got["plain"].token_ids) < 64
    assert got["plain"].text == "A" * len(got["plain"].token_ids)
    got = run(engine, {0: [("stop", prompt, replace(always_a, stop=("AA",)))]})
    assert got["stop"].text == "" and got["stop"].finish_reason is FinishReason.STOP
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(gqa, make_engine):
    """vLLM's min_tokens: no eos or stop token id among the first min_tokens tokens, and stop strings count
    only in text after them; a resumed request counts its resumed tokens."""
    engine = make_engine(gqa)
    prompt = random_prompts([7], seed=3)[0]
    free = engine.generate([prompt], replace(GREEDY, max_tokens=12))[0]
    stop_id = next(t for t in free[1:] if t != free[0])  # without min_tokens this id ends the output early
    held = replace(GREEDY, max_tokens=12, stop_token_ids=(stop_id,), min_tokens=6)
    tokens = engine.generate([prompt], held)[0]
    assert stop_id not in tokens[:6] and len(tokens) >= 6
    assert tokens[:1] == free[:1]  # the ban only bites where the stop id would have come
    if stop_id in tokens[6:]:
        assert tokens[-1] == stop_id  # once min_tokens are out, the stop id ends it as usual
    eos_engine = make_engine(gqa)
    eos_engine.eos_token_ids = frozenset({free[0]})  # the model's very first greedy token, taken as eos
    unbounded = replace(GREEDY, ignore_eos=False, max_tokens=5)
    assert eos_engine.generate([prompt], unbounded)[0] == [free[0]]
    assert free[0] not in eos_engine.generate([prompt], replace(unbounded, min_tokens=5))[0]
    engine.add_request("resumed", prompt, held, resume_token_ids=free[:6])  # six out already: the stop id may end it
    resumed = []
    while engine.has_unfinished():
        resumed += [t for o in engine.step() for t in o.new_token_ids]
    assert resumed == engine.generate([prompt + free[:6]], replace(held, min_tokens=0, max_tokens=6))[0]


# (6) Constrained decoding (grammar).

YES_NO = llguidance.LLMatcher.grammar_from_regex("(yes|no), (red|green|blue)")
JSON_ANSWER = llguidance.LLMatcher.grammar_from_json_schema(
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
     "required": ["answer", "sure"], "additionalProperties": False},
    overrides={"whitespace_flexible": False})


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_grammar_shapes_the_output_and_finishes_it(gqa, make_engine, sampling):
    engine = make_engine(gqa)
    prompts = random_prompts([5, 12, 8], seed=11)
    arrivals = {0: [("regex", prompts[0], replace(sampling, max_tokens=40, grammar=YES_NO)),
                    ("free", prompts[1], sampling)],
                2: [("json", prompts[2], replace(sampling, max_tokens=60, grammar=JSON_ANSWER))]}
    got = run(engine, arrivals)
    assert re.fullmatch(r"(yes|no), (red|green|blue)", got["regex"].text)
    answer = json.loads(got["json"].text)
    assert set(answer) == {"answer", "sure"} and answer["answer"] in ("yes", "no") and isinstance(answer["sure"], bool)
    assert got["regex"].finish_reason is got["json"].finish_reason is FinishReason.STOP
    assert got["free"].token_ids == run(make_engine(gqa), {0: [("free", prompts[1], sampling)]})["free"].token_ids


def test_a_bad_grammar_or_resumed_tokens_it_refuses_are_invalid_argument(gqa, make_engine):
    engine = make_engine(gqa)
    prompt = random_prompts([5])[0]
    with pytest.raises(InvalidArgument, match="^grammar: "):
        engine.add_request("bad", prompt, replace(GREEDY, grammar="start: nothing_defined"))
    with pytest.raises(InvalidArgument, match="^resume_token_ids: token 0 "):
        engine.add_request("resumed", prompt, replace(GREEDY, grammar=YES_NO),
                           resume_token_ids=gqa.tokenizer.encode("maybe"))
    assert not engine.has_unfinished()


def test_a_grammar_that_allows_no_token_ends_the_request_with_what_it_has(gqa, make_engine):
    # after "ab" the grammar's text is <|im_start|>'s, which llguidance's mask offers only as the token it refuses
    engine = make_engine(gqa)
    got = run(engine, {0: [("dead", random_prompts([5])[0], replace(GREEDY, grammar='start: "ab" "<|im_start|>"'))]})
    assert got["dead"].text == "ab" and got["dead"].finish_reason is FinishReason.STOP
    assert engine.num_grammar_dead_ends == 1  # ferry_instance_grammar_dead_ends_total
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
