"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and OLMo2: greedy tokens equal transformers' on the
same random weights (biases and norms random too; a prompt prefilled in chunks; Mixtral with a sliding
window shorter than the sequences), alone and in a busy batch (each expert sees other rows); a bfloat16
sparse MLP gives transformers' bits; and the config's MoE fields are read as transformers reads them."""

from __future__ import annotations

import copy
import os
import pathlib
from dataclasses import replace

import pytest
import torch

from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.model import load_model
from services.instance.engine.model_config import ModelConfig
from services.instance.engine.request import SamplingParams
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.unit.instance.hf_families import PROMPTS, assert_greedy_equals_transformers, save_random_family_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, initializer_range=0.2)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=7)),
    # a shared expert; layer 1 dense; top 2 of 6 not renormalized
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                                    num_experts_per_tok=2, shared_expert_intermediate_size=80,
                                                    mlp_only_layers=[1])),
    # per-head q/k norms; every second layer sparse; renormalized top 3 of 8
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                    num_experts_per_tok=3, norm_topk_prob=True, head_dim=16,
                                                    decoder_sparse_step=2)),
    # q/k norms over all heads together, q/k/v clamped; top 2 of 6 not renormalized
    "olmoe": (transformers.OlmoeConfig, dict(intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                             clip_qkv=2.0)),
    # dense: norms after attention and after the MLP only; q/k norms over all heads together
    "olmo2": (transformers.Olmo2Config, dict(intermediate_size=96)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[pathlib.Path, object]:
    config_class, extras = FAMILIES[request.param]
    return save_random_family_model(tmp_path_factory.mktemp("models") / f"tiny-{request.param}",
                                    config_class(**COMMON, **extras))


def test_greedy_tokens_equal_transformers_alone_and_batched(family, tmp_path):
    model_dir, hf_model = family
    assert_greedy_equals_transformers(model_dir, hf_model, f"ferry-test-moe-{tmp_path.name}")


def logprob_trace(engine, watched: list[int], others: list[list[int]]) -> list:
    """The watched request's logprobs, step by step, with `others` joining one a step."""
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    engine.add_request("watched", watched, sampling)
    trace, waiting = [], list(others)
    while engine.scheduler.has_unfinished() or waiting:
        if waiting:
            engine.add_request(f"other-{len(waiting)}", waiting.pop(), replace(sampling, max_tokens=9))
        trace += [o.logprobs for o in engine.step() if o.request_id == "watched" and o.logprobs]
    return trace


def test_logprobs_are_the_same_bits_alone_and_beside_requests_routed_elsewhere(family, tmp_path):
    """Each expert's matmul takes the rows routed to it, which change with the batch: its packed product
    gives every row the same bits whatever the count (packed_linear), and each token's experts are added
    in expert order, so a request's bits depend on its own routing only."""
    model_dir, _ = family
    loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-test-moe-bits-{os.getpid()}-{tmp_path.name}", kv_cache_mib=8,
                                     max_num_batched_tokens=64, enable_prefix_caching=False))
    try:
        alone = logprob_trace(loaded.engine, PROMPTS[2], [])
        busy = logprob_trace(loaded.engine, PROMPTS[2], [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0][::-1]])
        assert len(alone) == 16 and busy == alone
    finally:
        loaded.close()


def test_a_bfloat16_sparse_mlp_gives_transformers_bits(family):
    """Found by a review: the weighted sum was rounded to bfloat16 after every expert (and Mixtral's router
    weights rounded too); transformers' grouped experts add in float32 and round once."""
    model_dir, hf_model = family
    moe = ModelConfig.from_dir(model_dir).moe
    if moe is None:
        pytest.skip("a dense family: no sparse MLP")
    ours = load_model(model_dir, dtype=torch.bfloat16)
    theirs = copy.deepcopy(hf_model).to(torch.bfloat16)
    layer = moe.sparse_layers.index(True)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.layers[layer].mlp(x), theirs.model.layers[layer].mlp(x[None])[0])


def test_bfloat16_norms_give_transformers_bits(family):
    """Found by a review: OLMo2 scales by its norm weights in float32 before rounding, the others after."""
    model_dir, hf_model = family
    ours, theirs = load_model(model_dir, dtype=torch.bfloat16), copy.deepcopy(hf_model).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.norm(x), theirs.model.norm(x))
        attention = theirs.model.layers[0].self_attn
        if hasattr(attention, "q_norm"):
            width = attention.q_norm.weight.shape[0]
            q = torch.randn(16, width, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            assert torch.equal(ours.layers[0].self_attn.q_norm(q), attention.q_norm(q))


def test_config_reads_each_familys_fields_as_transformers_does(family):
    model_dir, _ = family
    config = ModelConfig.from_dir(model_dir)
    moe = config.moe
    if config.model_type == "mixtral":
        assert (moe.num_experts, moe.top_k, moe.renormalize, moe.shared_intermediate_size) == (4, 2, True, 0)
        assert moe.sparse_layers == (True, True, True) and moe.expert_intermediate_size == 96
    elif config.model_type == "qwen2_moe":
        assert (moe.num_experts, moe.top_k, moe.renormalize, moe.shared_intermediate_size) == (6, 2, False, 80)
        assert moe.sparse_layers == (True, False, True) and config.qkv_bias and not config.o_bias
    elif config.model_type == "qwen3_moe":
        assert (moe.num_experts, moe.top_k, moe.renormalize, moe.shared_intermediate_size) == (8, 3, True, 0)
        assert moe.sparse_layers == (False, True, False) and config.qk_norm
    elif config.model_type == "olmoe":
        assert (moe.num_experts, moe.top_k, moe.renormalize, moe.shared_intermediate_size) == (6, 2, False, 0)
        assert config.qk_norm_full and config.clip_qkv == 2.0 and not config.post_norms_only
    else:
        assert moe is None and config.qk_norm_full and config.post_norms_only and config.clip_qkv is None


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and the number of experts \\(8\\)"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ({"use_sliding_window": True}, "use_sliding_window: sliding windows are not supported for qwen3_moe"),
])
def test_an_expert_setting_that_cannot_run_is_refused(changes, message):
    raw = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "num_experts": 8, **changes}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)
