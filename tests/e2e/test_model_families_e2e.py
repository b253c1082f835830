"""Other model families through the whole cluster: random Qwen3, Gemma, Gemma 2, Gemma 3,
Phi-3, Granite, Mixtral, GPT-NeoX, GPT-2, SmolLM3, OLMo, Cohere, Cohere 2, GPT-J, OPT, Falcon, GLM, GLM-4, Helium,
ERNIE 4.5, Seed-OSS, EXAONE 4, Hunyuan, Ministral, OLMo 3, Arcee and GPT-BigCode checkpoints written by
transformers, served by the launcher, answered
greedily and migrated mid-stream; every token must equal transformers' `generate`, and the frontend serves the
context the model allows (Phi-3's longrope). The sliding windows are far shorter than the
sequences, so the windowed layers' masks are what is checked there."""

from __future__ import annotations

import pathlib

import openai
import pytest
import torch

from services.common.gen.ferry.v1 import manager_pb2
from services.instance.engine.tokenizer import Tokenizer
from services.instance.models import build_tiny_model
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.e2e.conftest import launched_cluster, model_name

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)


FAMILIES = {
    # per-head q/k RMSNorm, head_dim 32 with hidden_size 64
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32), 1024),
    # GeGLU, norms scaling by 1 + weight, scaled embeddings, one KV head
    "gemma": (transformers.GemmaConfig, dict(head_dim=32, num_key_value_heads=1), 1024),
    # besides: norms around attention and MLP, soft-capped scores and logits, alternate sliding layers
    "gemma2": (transformers.Gemma2Config, dict(head_dim=32, query_pre_attn_scalar=48, attn_logit_softcapping=3.0,
                                               final_logit_softcapping=4.0, sliding_window=16), 1024),
    # besides Gemma 2's: per-head q/k norms, a RoPE of their own on the sliding layers, no soft-capping
    "gemma3": (transformers.Gemma3TextConfig, dict(head_dim=32, query_pre_attn_scalar=48, sliding_window=16,
                                                   sliding_window_pattern=2), 1024),
    # fused checkpoint tensors, partial rotary, a sliding window; longrope: served up to its pretraining length
    "phi3": (transformers.Phi3Config, dict(
        sliding_window=24, original_max_position_embeddings=512,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [4.0] * 4,
                         "original_max_position_embeddings": 512}), 512),
    # embedding, residual, attention and logits multipliers
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=4.0, residual_multiplier=0.4,
                                                 attention_multiplier=0.15, logits_scaling=2.0), 1024),
    # mixture of experts: each token through its top 2 of 4 gated MLPs
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2), 1024),
    # LayerNorms, q/k/v fused and interleaved per head, partial rotary, parallel attention and plain MLP
    "gpt_neox": (transformers.GPTNeoXConfig, dict(), 1024),
    # learned positions, no RoPE: served up to n_positions (GPT2Config's name for max_position_embeddings)
    "gpt2": (transformers.GPT2Config, dict(max_position_embeddings=512), 512),
    # NoPE on the second layer, which slides
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=16),
                1024),
    # LayerNorms without parameters, q/k/v clamped
    "olmo": (transformers.OlmoConfig, dict(clip_qkv=2.0), 1024),
    # parallel blocks from one bias-free LayerNorm, interleaved RoPE, per-head q/k LayerNorms, logit_scale
    "cohere": (transformers.CohereConfig, dict(use_qk_norm=True, logit_scale=0.5), 1024),
    # a sliding layer with RoPE, then a global one without
    "cohere2": (transformers.Cohere2Config, dict(sliding_window=16, sliding_window_pattern=2), 1024),
    # parallel blocks, interleaved partial RoPE, a biased LM head
    "gptj": (transformers.GPTJConfig, dict(rotary_dim=8, tie_word_embeddings=False), 1024),
    # learned positions at an offset of 2, ReLU
    "opt": (transformers.OPTConfig, dict(ffn_dim=128, word_embed_proj_dim=64), 1024),
    # Falcon-40B's layout: q/k/v grouped by key/value head, parallel blocks from two norms
    "falcon": (transformers.FalconConfig, dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=128),
               1024),
    # interleaved RoPE over half of each head, q/k/v biases, fused gate/up
    "glm": (transformers.GlmConfig, dict(head_dim=16), 1024),
    # besides: norms after attention and after the MLP
    "glm4": (transformers.Glm4Config, dict(head_dim=16), 1024),
    # interleaved RoPE, norms scaling in float32
    "helium": (transformers.HeliumConfig, dict(head_dim=16), 1024),
    # interleaved RoPE, biases everywhere
    "ernie4_5": (transformers.Ernie4_5Config, dict(head_dim=16, use_bias=True), 1024),
    # q/k/v and o biases
    "seed_oss": (transformers.SeedOssConfig, dict(head_dim=16, attention_out_bias=True), 1024),
    # norms after attention and the MLP, per-head q/k norms, a sliding layer with RoPE then a global one without
    "exaone4": (transformers.Exaone4Config, dict(head_dim=16, sliding_window=16, sliding_window_pattern=2), 1024),
    # per-head q/k norms after RoPE, NTK alpha
    "hunyuan_v1_dense": (transformers.HunYuanDenseV1Config, dict(
        head_dim=16, rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "rope_theta": 10000.0, "factor": 1.0}),
        1024),
    # a window on the first layer only
    "ministral": (transformers.MinistralConfig, dict(head_dim=16, sliding_window=16,
                                                     layer_types=["sliding_attention", "full_attention"]), 1024),
    # OLMo2's blocks, a sliding layer then a full one, each with its own RoPE
    "olmo3": (transformers.Olmo3Config, dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0},
                                                              "sliding_attention": {"rope_type": "default"}}), 1024),
    # a plain relu2 MLP
    "arcee": (transformers.ArceeConfig, dict(head_dim=16), 1024),
    # StarCoder 1: learned positions, multi-query attention fused in c_attn
    "gpt_bigcode": (transformers.GPTBigCodeConfig, dict(max_position_embeddings=512), 512),
}


# `make test` serves three (a cluster each costs ~15 s on CI's 2 cores): a sliding window with RoPEs of its own,
# a mixture of experts, learned positions with GPT-2's Conv1D; the rest are slow-marked (each family's engine
# is checked against transformers in tests/unit/instance/test_model_families.py either way).
IN_MAKE_TEST = {"gemma3", "mixtral", "gpt2"}


@pytest.fixture(scope="module", params=[name if name in IN_MAKE_TEST else pytest.param(name, marks=pytest.mark.slow)
                                        for name in sorted(FAMILIES)])
def family(request, tmp_path_factory) -> tuple[pathlib.Path, object, int]:
    """The tiny models' tokenizer with random weights of another family (and the transformers
    model, and the context the cluster should serve)."""
    config_class, extras, context = FAMILIES[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{request.param}", "gqa-tied")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model_dir / name).unlink()
    torch.manual_seed(0)
    config = config_class(**{
        **dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.2),
        **extras})
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1)
    hf_model.save_pretrained(model_dir)
    return model_dir, hf_model, context


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    with launched_cluster(family[0], tmp_path_factory.mktemp("cluster"), "--instances", "2",
                          "--kv-cache-mib", "16") as cluster:
        yield cluster


def hf_greedy(family, prompt: str, max_tokens: int) -> list[int]:
    model_dir, hf_model, _ = family
    prompt_ids = Tokenizer.from_dir(model_dir).encode(prompt)
    hf_model.generation_config.eos_token_id = None  # taken where it is the argmax, as ignore_eos takes it
    with torch.no_grad():
        output = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)
    return output[0, len(prompt_ids):].tolist()


async def test_greedy_tokens_equal_transformers(cluster, client, family):
    for prompt in ("hello world", "the quick brown fox jumps"):
        completion = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=24,
                                                     temperature=0, extra_body={"return_token_ids": True,
                                                                                "ignore_eos": True})
        assert completion.choices[0].model_extra["token_ids"] == hf_greedy(family, prompt, 24)


async def test_a_request_migrated_mid_stream_keeps_transformers_tokens(cluster, admin, client, family):
    # As long as the context allows: a loaded machine can take a second or more to migrate a cold cluster's first request.
    prompt, max_tokens = "a request that moves", family[2] - 24
    stream = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids, moved = [], None
    async for chunk in stream:
        if not chunk.choices:
            continue
        token_ids += chunk.choices[0].model_extra.get("token_ids") or []
        if moved is None and len(token_ids) >= 8:
            moved = await admin.Migrate(manager_pb2.MigrateRequest(request_id=chunk.id), timeout=60)
    assert moved is not None and moved.src_instance_id != moved.dst_instance_id and moved.num_blocks > 0
    assert token_ids == hf_greedy(family, prompt, max_tokens)


async def test_the_served_context_is_the_models(cluster, client, family):
    _, _, context = family
    models = await client.models.list()
    assert models.data[0].model_extra["max_model_len"] == context
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {context} tokens"):
        await client.completions.create(model=model_name(cluster), prompt="hello", max_tokens=context)
