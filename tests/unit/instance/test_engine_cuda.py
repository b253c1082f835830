"""The torch engine on a GPU (`--device cuda`): its greedy tokens equal transformers' on the
same GPU, with continuous batching, preemption, chunked prefill and the in-place decode path
of long contexts; seeded sampling and resumes behave as on the host. Skipped without CUDA."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from services.instance.engine import attention
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.model import load_model
from services.instance.engine.request import FinishReason, SamplingParams
from services.instance.engine.tokenizer import Tokenizer
from tests.unit.instance.test_engine import CONFIGS, GREEDY, SEEDED, Tiny, random_prompts, run

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda", 0)
# Past IN_PLACE_MIN_KEYS as the test sets it (the tiny models have 1024 positions, the default's
# 1024 keys do not fit them): decode reads its blocks in place, in several segments.
LONG_PROMPT, IN_PLACE_MIN_KEYS, SEGMENT_KEYS = 100, 48, 16


@pytest.fixture(scope="module", params=["tiny_mha_model_dir", "tiny_model_dir"])
def tiny_cuda(request) -> Tiny:
    model_dir = request.getfixturevalue(request.param)
    return Tiny(str(model_dir), load_model(model_dir, device=CUDA), Tokenizer.from_dir(model_dir))


@pytest.fixture
def make_cuda_engine() -> Iterator[Callable[..., LLMEngine]]:
    caches: list[KvCache] = []

    def make(tiny: Tiny, num_blocks: int = 512, block_size: int = 4, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 512, max_model_len: int = 2048) -> LLMEngine:
        c = tiny.model.config
        geometry = KvGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, num_blocks,
                              torch.float32)
        cache = KvCache.create(f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry, CUDA)
        caches.append(cache)
        config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        return LLMEngine(tiny.model, tiny.tokenizer, cache, config)

    yield make
    for cache in caches:
        cache.close()


def cuda_reference_greedy(tiny: Tiny, prompt: list[int], max_tokens: int) -> list[int]:
    hf = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).to(CUDA)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], device=CUDA)
    return hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def test_the_model_and_its_kv_cache_live_on_the_gpu(tiny_cuda, make_cuda_engine):
    engine = make_cuda_engine(tiny_cuda)
    assert engine.kv_cache.tensor.device == CUDA and engine.kv_cache.ipc_handle is not None
    assert all(p.device == CUDA for p in tiny_cuda.model.parameters())


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_on_cuda_matches_transformers_on_cuda(tiny_cuda, make_cuda_engine, config):
    engine = make_cuda_engine(tiny_cuda, **CONFIGS[config])
    prompts = random_prompts([3, 17, 9, 25, 1, 12])
    arrivals: dict[int, list[tuple]] = {0: [], 2: [], 5: []}
    for i, prompt in enumerate(prompts):
        arrivals[(0, 2, 5)[i % 3]].append((f"r{i}", prompt, GREEDY))
    collected = run(engine, arrivals)
    for i, prompt in enumerate(prompts):
        assert collected[f"r{i}"].token_ids == cuda_reference_greedy(tiny_cuda, prompt, GREEDY.max_tokens)
    assert engine.block_manager.num_free_blocks == CONFIGS[config]["num_blocks"]


def test_a_long_context_decodes_in_place_on_cuda(tiny_cuda, make_cuda_engine, monkeypatch):
    monkeypatch.setattr(attention, "IN_PLACE_MIN_KEYS", IN_PLACE_MIN_KEYS)
    monkeypatch.setattr(attention, "SEGMENT_KEYS", SEGMENT_KEYS)
    read_in_place = []
    attend_in_place = attention._attend_in_place
    monkeypatch.setattr(attention, "_attend_in_place", lambda *args: read_in_place.append(1) or attend_in_place(*args))
    prompt = random_prompts([LONG_PROMPT], seed=9)[0]
    engine = make_cuda_engine(tiny_cuda, max_num_batched_tokens=256)
    collected = run(engine, {0: [("long", prompt, GREEDY), ("short", prompt[:40], GREEDY)]})
    assert read_in_place
    assert collected["long"].token_ids == cuda_reference_greedy(tiny_cuda, prompt, GREEDY.max_tokens)
    assert collected["short"].token_ids == cuda_reference_greedy(tiny_cuda, prompt[:40], GREEDY.max_tokens)


def test_seeded_sampling_and_resumes_on_cuda(tiny_cuda, make_cuda_engine):
    prompt = random_prompts([13], seed=5)[0]
    alone = run(make_cuda_engine(tiny_cuda), {0: [("x", prompt, SEEDED)]})["x"]
    busy = run(make_cuda_engine(tiny_cuda, max_num_batched_tokens=8),
               {0: [("a", random_prompts([30], seed=6)[0], SamplingParams(temperature=1.2, seed=1, max_tokens=20))],
                2: [("x", prompt, SEEDED)]})["x"]
    assert busy.token_ids == alone.token_ids and len(alone.token_ids) == SEEDED.max_tokens
    resumed = run(make_cuda_engine(tiny_cuda), {0: [("x", prompt, SEEDED, {"resume_token_ids": alone.token_ids[:4]})]})
    assert resumed["x"].token_ids == alone.token_ids[4:] and resumed["x"].finish_reason is FinishReason.LENGTH
