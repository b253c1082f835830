"""Families added on top of Llama's switches: SmolLM3 (NoPE layers), the first OLMo (LayerNorms without parameters,
`clip_qkv`), Cohere / Command-R (parallel blocks from one bias-free LayerNorm, interleaved RoPE, `logit_scale`, per-head
q/k LayerNorms), Cohere 2 (sliding layers with RoPE, global ones without), GPT-J (parallel blocks, interleaved partial
RoPE, a biased LM head), OPT (learned positions at an offset of 2, ReLU) and Falcon (its three q/k/v layouts, one or
two norms per parallel block, or sequential blocks), and the Llamas with interleaved RoPE or other biases: GLM (fused
gate/up, half of each head rotated), GLM-4 (besides: norms around attention and the MLP), Helium (norms scaling in
float32), ERNIE 4.5 (`use_bias`) and Seed-OSS (`attention_out_bias`); EXAONE 4 (OLMo2's norms after attention and
the MLP, Qwen3's per-head q/k norms, sliding layers with RoPE and global ones without), Hunyuan (per-head q/k norms
after RoPE, NTK alpha), Ministral (windows per `layer_types`), OLMo 3 (OLMo2's blocks, sliding layers with a RoPE of
their own), Arcee (a plain relu2 MLP) and GPT-BigCode (StarCoder 1: GPT-2's layout in Linear weights, multi-query
or multi-head). Greedy tokens equal transformers' on the
same random weights (norms and biases random too; a prompt prefilled in chunks; sliding windows shorter than the
sequences), alone and in a busy batch; float32 logits equal transformers' to a tight tolerance; bfloat16 norms give
its bits; and the config's fields are read as transformers reads them."""

from __future__ import annotations

import copy
import os
import pathlib

import pytest
import torch

from services.instance.engine.model import load_model
from services.instance.engine.model_config import ModelConfig
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.unit.instance.hf_families import (PROMPTS, assert_float32_logits_equal_transformers,
                                             assert_greedy_equals_transformers, prefill_logits, save_random_family_model)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, initializer_range=0.2)
FAMILIES = {
    # every second layer without RoPE, those layers with a sliding window shorter than the sequences
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5)),
    # transformers' default: the fourth layer without RoPE, no window
    "smollm3-default": (transformers.SmolLM3Config, dict()),
    # LayerNorms without parameters, queries, keys and values clamped, attention biases
    "olmo": (transformers.OlmoConfig, dict(clip_qkv=1.0, attention_bias=True)),
    # parallel attention and MLP from one LayerNorm without bias, interleaved RoPE, per-head q/k LayerNorms, logit_scale
    "cohere": (transformers.CohereConfig, dict(use_qk_norm=True, logit_scale=0.5, attention_bias=True)),
    "cohere-untied": (transformers.CohereConfig, dict(tie_word_embeddings=False)),
    # three sliding layers with RoPE, then a global one without (sliding_window_pattern 4)
    "cohere2": (transformers.Cohere2Config, dict(sliding_window=5, logit_scale=0.7)),
    # attention and a plain gelu_new MLP from one norm, 8 of each head's 16 dims rotated in adjacent pairs
    "gptj": (transformers.GPTJConfig, dict(n_embd=64, n_layer=3, n_head=4, n_inner=96, n_positions=128, rotary_dim=8)),
    # learned positions (row p + 2 for position p), biases, ReLU, a tied head
    "opt": (transformers.OPTConfig, dict(ffn_dim=96, word_embed_proj_dim=64)),
    "opt-without-biases": (transformers.OPTConfig, dict(ffn_dim=96, enable_bias=False,
                                                        layer_norm_elementwise_affine=False)),
    # Falcon-40B's layout: q/k/v grouped by key/value head, attention and MLP in parallel from two norms
    "falcon-new": (transformers.FalconConfig, dict(new_decoder_architecture=True, num_kv_heads=2, bias=True,
                                                   ffn_hidden_size=96)),
    # Falcon 2's: the same from one norm
    "falcon-new-one-norm": (transformers.FalconConfig, dict(new_decoder_architecture=True, num_kv_heads=2,
                                                            num_ln_in_parallel_attn=1, ffn_hidden_size=96)),
    # Falcon-7B's: multi-query, parallel from one norm
    "falcon-multi-query": (transformers.FalconConfig, dict(multi_query=True, ffn_hidden_size=96)),
    # multi-head, q/k/v interleaved per head, sequential blocks, biases
    "falcon-sequential": (transformers.FalconConfig, dict(multi_query=False, parallel_attn=False, bias=True,
                                                          ffn_hidden_size=96)),
    # interleaved RoPE over half of each head, q/k/v biases, gate/up fused in the checkpoint
    "glm": (transformers.GlmConfig, dict(head_dim=16)),
    # besides: norms after attention and after the MLP (as Gemma 2's), no biases
    "glm4": (transformers.Glm4Config, dict(head_dim=16, attention_bias=False)),
    # interleaved RoPE, norms scaling in float32, q/k/v and MLP biases
    "helium": (transformers.HeliumConfig, dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    # interleaved RoPE, biases on every projection
    "ernie4_5": (transformers.Ernie4_5Config, dict(head_dim=16, use_bias=True)),
    # q/k/v biases, o's with attention_out_bias, MLP biases
    "seed_oss": (transformers.SeedOssConfig, dict(head_dim=16, attention_out_bias=True, mlp_bias=True)),
    # norms after attention and the MLP only, per-head q/k norms, three sliding layers with RoPE, a global one without
    "exaone4": (transformers.Exaone4Config, dict(head_dim=16, sliding_window=5)),
    # without a sliding window every layer is global, with RoPE
    "exaone4-no-window": (transformers.Exaone4Config, dict(head_dim=16, sliding_window=None,
                                                           layer_types=["full_attention"] * 4)),
    # per-head q/k norms after RoPE, whose base NTK alpha stretches, attention biases
    "hunyuan_v1_dense": (transformers.HunYuanDenseV1Config, dict(
        head_dim=16, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "rope_theta": 10000.0, "factor": 1.0})),
    # a window on the layers layer_types marks
    "ministral": (transformers.MinistralConfig, dict(head_dim=16, sliding_window=5,
                                                     layer_types=["sliding_attention", "full_attention"] * 2)),
    # OLMo2's blocks, three sliding layers of four rotated without the full layers' linear scaling
    "olmo3": (transformers.Olmo3Config, dict(sliding_window=5, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
    # a plain up -> relu2 -> down MLP, biases
    "arcee": (transformers.ArceeConfig, dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    # StarCoder 1 / SantaCoder: learned positions, multi-query attention fused in c_attn, biases everywhere
    "gpt_bigcode": (transformers.GPTBigCodeConfig, dict(n_embd=64, n_layer=3, n_head=4, n_inner=96, n_positions=128)),
    # multi-head: c_attn's rows run head by head; scores unscaled
    "gpt_bigcode-multi-head": (transformers.GPTBigCodeConfig, dict(n_embd=64, n_layer=3, n_head=4, n_inner=96,
                                                                   n_positions=128, multi_query=False,
                                                                   scale_attn_weights=False)),
}
GPT_NAMES = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings"}  # GPTJConfig's are n_embd, n_inner, n_layer, n_head, n_positions
MODEL_TYPES = sorted({config_class.model_type for config_class, _ in FAMILIES.values()})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[pathlib.Path, object]:
    config_class, extras = FAMILIES[request.param]
    gpt_names = config_class.model_type in ("gptj", "gpt_bigcode")
    common = {k: v for k, v in COMMON.items() if not gpt_names or k not in GPT_NAMES}
    return save_random_family_model(tmp_path_factory.mktemp("models") / f"tiny-{request.param}",
                                    config_class(**common, **extras))


def test_greedy_tokens_equal_transformers_alone_and_batched(family, tmp_path):
    model_dir, hf_model = family
    assert_greedy_equals_transformers(model_dir, hf_model, f"ferry-test-more-{os.getpid()}-{tmp_path.name}")


def test_float32_logits_equal_transformers(family):
    assert_float32_logits_equal_transformers(*family)


def test_bfloat16_norms_give_transformers_bits(family):
    model_dir, hf_model = family
    ours, theirs = load_model(model_dir, dtype=torch.bfloat16), copy.deepcopy(hf_model).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    base = theirs.base_model
    their_norm = next(getattr(base, name) for name in ("norm", "ln_f") if hasattr(base, name)) if not hasattr(
        base, "decoder") else base.decoder.final_layer_norm
    their_attention = getattr(base.layers[0], "self_attn", None) if hasattr(base, "layers") else None
    with torch.no_grad():
        assert torch.equal(ours.norm(x), their_norm(x))
        if getattr(their_attention, "q_norm", None) is not None and ours.config.qk_norm_full:  # over all heads
            q = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            assert torch.equal(ours.layers[0].self_attn.q_norm(q), their_attention.q_norm(q))
        elif getattr(their_attention, "q_norm", None) is not None:  # per head (Cohere's: [heads, head_dim] weights)
            q = torch.randn(16, 4, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            # Cohere's heads' dims are permuted (interleaved RoPE, weights.py): compare in the checkpoint's order
            order = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2))) if ours.config.rope_interleaved \
                else torch.arange(16)
            ours_q = torch.empty_like(q)
            ours_q[..., order] = ours.layers[0].self_attn.q_norm(q[..., order])
            assert torch.equal(ours_q, their_attention.q_norm(q))


def test_config_reads_each_familys_fields_as_transformers_does(family):
    model_dir, hf_model = family
    config, theirs = ModelConfig.from_dir(model_dir), hf_model.config
    layer_types = getattr(theirs, "layer_types", None) or ["full_attention"] * 4
    windows = [theirs.sliding_window if kind == "sliding_attention" else None for kind in layer_types]
    if config.model_type == "smollm3":
        assert [not flag for flag in config.nope_layers] == [bool(flag) for flag in theirs.no_rope_layers]
        assert list(config.layer_windows) == (windows if theirs.use_sliding_window else [None] * 4)
        assert config.norm_eps == theirs.rms_norm_eps and not config.layer_norm
    elif config.model_type == "olmo":
        assert config.layer_norm and not config.norm_affine and config.norm_eps == 1e-5 and config.clip_qkv == 1.0
        assert config.qkv_bias and config.o_bias and not config.mlp_bias and config.nope_layers == ()
    elif config.model_type == "gptj":
        assert config.norm_eps == theirs.layer_norm_epsilon and config.rope_interleaved and config.rope.rotary_dim == 8
        assert config.parallel_residual and config.shared_block_norm and config.lm_head_bias and not config.qkv_bias
        assert config.activation == "gelu_new" and config.intermediate_size == 96 and config.num_key_value_heads == 4
    elif config.model_type == "opt":
        assert config.learned_positions and config.activation == "relu" and config.tie_word_embeddings
        assert config.qkv_bias == config.mlp_bias == theirs.enable_bias
        assert config.norm_affine == theirs.layer_norm_elementwise_affine and config.context_length == 512
    elif config.model_type == "falcon":
        kv_heads = theirs.num_kv_heads if theirs.new_decoder_architecture else 1 if theirs.multi_query else 4
        assert config.num_key_value_heads == kv_heads and config.parallel_residual == theirs.parallel_attn
        assert config.shared_block_norm == (theirs.parallel_attn and theirs.num_ln_in_parallel_attn != 2)
        assert config.qkv_bias == config.mlp_bias == theirs.bias and config.norm_eps == theirs.layer_norm_epsilon
    elif config.model_type in ("glm", "glm4", "helium", "ernie4_5", "seed_oss"):
        assert config.norm_eps == theirs.rms_norm_eps and not config.layer_norm and config.head_dim == 16
        assert config.rope_interleaved == (config.model_type != "seed_oss")
        assert config.rope.rotary_dim == (8 if config.model_type in ("glm", "glm4") else 16)
        assert config.sandwich_norms == (config.model_type == "glm4")
        assert config.norm_scales_in_float32 == (config.model_type == "helium")
        biases = {"glm": (True, False, False), "glm4": (False, False, False), "helium": (True, False, True),
                  "ernie4_5": (True, True, True), "seed_oss": (True, True, True)}[config.model_type]
        assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases
    elif config.model_type == "exaone4":
        assert config.qk_norm and config.post_norms_only and not config.norm_scales_in_float32
        assert list(config.layer_windows) == windows
        assert list(config.nope_layers or [False] * 4) == [theirs.sliding_window is not None and window is None
                                                           for window in windows]
    elif config.model_type == "hunyuan_v1_dense":
        assert config.qk_norm and config.qk_norm_after_rope and config.qkv_bias and config.o_bias
        assert config.rope.theta == 10000.0 * 50.0 ** (16 / 14)
    elif config.model_type == "olmo3":
        assert config.qk_norm_full and config.post_norms_only and config.norm_scales_in_float32
        assert list(config.layer_windows) == windows == [5, 5, 5, None] and config.nope_layers == ()
        assert (config.rope.rope_type, config.rope.factor, config.sliding_rope.rope_type) == ("linear", 4.0, "default")
    elif config.model_type == "arcee":
        assert config.activation == "relu2" and not config.gated_mlp and config.qkv_bias and config.mlp_bias
    elif config.model_type == "gpt_bigcode":
        assert config.learned_positions and config.num_key_value_heads == (1 if theirs.multi_query else 4)
        assert config.attention_scale == (None if theirs.scale_attn_weights else 1.0) and config.context_length == 128
        assert config.activation == "gelu_pytorch_tanh" and config.qkv_bias and config.tie_word_embeddings
    elif config.model_type == "ministral":
        assert list(config.layer_windows) == windows == [5, None, 5, None] and not config.qkv_bias
    else:
        assert config.layer_norm and not config.norm_bias and config.norm_eps == theirs.layer_norm_eps
        assert config.parallel_residual and config.shared_block_norm and config.rope_interleaved
        assert config.logits_scale == theirs.logit_scale and config.tie_word_embeddings == theirs.tie_word_embeddings
        assert config.qk_norm == config.qk_norm_per_head_weights == bool(getattr(theirs, "use_qk_norm", False))
        if config.model_type == "cohere2":
            assert list(config.layer_windows) == windows == [5, 5, 5, None]
            assert config.nope_layers == (False, False, False, True)


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t not in ("gptj", "opt", "falcon", "gpt_bigcode")])
def test_fields_left_out_take_transformers_defaults(model_type):
    # Helium's default of 20 key/value heads and Seed-OSS's 8 do not divide 4 (test_num_key_value_heads_left_out_...)
    kv_heads = {"num_key_value_heads": 2} if model_type in ("helium", "seed_oss", "exaone4", "ministral") else {}
    reference = transformers.AutoConfig.for_model(model_type, num_hidden_layers=8, num_attention_heads=4,
                                                  hidden_size=64, **kv_heads)
    config = ModelConfig.from_dict({"model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
                                    "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 100, **kv_heads})
    eps = getattr(reference, "layer_norm_eps", None) or getattr(reference, "rms_norm_eps", None) or 1e-5  # OLMo: 1e-5
    assert config.norm_eps == eps
    assert config.tie_word_embeddings == reference.tie_word_embeddings
    rope_parameters = reference.rope_parameters.get("full_attention", reference.rope_parameters)  # OLMo 3: per type
    assert config.rope.theta == rope_parameters["rope_theta"] and config.activation == reference.hidden_act
    assert config.num_key_value_heads == reference.num_key_value_heads
    assert config.head_dim == (getattr(reference, "head_dim", None) or 16)
    assert config.rope.rotary_dim == config.head_dim * rope_parameters.get("partial_rotary_factor", 1.0)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (
        getattr(reference, "attention_bias", False) or getattr(reference, "use_bias", False),
        getattr(reference, "attention_out_bias", False) or getattr(reference, "use_bias", False) or (
            model_type in ("olmo", "cohere", "cohere2", "smollm3") and reference.attention_bias),
        getattr(reference, "use_bias", False) or (
            model_type not in ("glm", "glm4", "olmo", "cohere", "cohere2") and getattr(reference, "mlp_bias", False)))
    layer_types = getattr(reference, "layer_types", None) or ["full_attention"] * 8
    window = getattr(reference, "sliding_window", None)
    if model_type == "smollm3":
        window = window if reference.use_sliding_window else None
        assert [not flag for flag in config.nope_layers] == [bool(flag) for flag in reference.no_rope_layers]
    assert list(config.layer_windows) == [window if kind == "sliding_attention" else None for kind in layer_types]
    if model_type in ("cohere2", "exaone4"):
        assert config.nope_layers == tuple(kind == "full_attention" for kind in layer_types)


@pytest.mark.parametrize("changes, message", [
    ({"no_rope_layers": [1, 0]}, r"no_rope_layers must list one 0 or 1 per layer \(4\)"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive integer, got 0"),
    ({"model_type": "exaone4", "num_key_value_heads": 2, "sliding_window_pattern": "LLLG"},
     "sliding_window_pattern must be a positive integer where layer_types is not given, got 'LLLG'"),
])
def test_a_nope_or_window_setting_that_cannot_run_is_refused(changes, message):
    raw = {"model_type": "smollm3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
           "num_attention_heads": 4, "vocab_size": 100, **changes}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_smollm3_reads_its_sliding_layers_from_layer_types_or_its_nope_layers():
    raw = {"model_type": "smollm3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
           "num_attention_heads": 4, "vocab_size": 100, "use_sliding_window": True, "sliding_window": 8}
    assert ModelConfig.from_dict(raw).layer_windows == (None, None, None, 8)  # the fourth: NoPE
    with_types = {**raw, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert ModelConfig.from_dict(with_types).layer_windows == (8, None, 8, None)
    assert ModelConfig.from_dict({**raw, "use_sliding_window": False}).layer_windows == (None,) * 4


def test_gptj_opt_bigcode_and_falcon_fields_left_out_take_transformers_defaults():
    sizes = {"vocab_size": 100}
    gptj, reference = ModelConfig.from_dict({"model_type": "gptj", **sizes}), transformers.GPTJConfig()
    assert (gptj.hidden_size, reference.n_embd) == (4096, 4096)
    assert (gptj.hidden_size, gptj.num_hidden_layers, gptj.num_attention_heads, gptj.intermediate_size) == (
        reference.n_embd, reference.n_layer, reference.n_head, 4 * reference.n_embd)
    assert (gptj.rope.rotary_dim, gptj.rope.theta, gptj.norm_eps, gptj.tie_word_embeddings, gptj.context_length) == (
        reference.rotary_dim, 10000.0, reference.layer_norm_epsilon, reference.tie_word_embeddings,
        reference.n_positions)
    opt, reference = ModelConfig.from_dict({"model_type": "opt", **sizes}), transformers.OPTConfig()
    assert (opt.hidden_size, opt.num_hidden_layers, opt.num_attention_heads, opt.intermediate_size) == (
        reference.hidden_size, reference.num_hidden_layers, reference.num_attention_heads, reference.ffn_dim)
    assert (opt.activation, opt.qkv_bias, opt.tie_word_embeddings, opt.context_length) == (
        reference.activation_function, reference.enable_bias, reference.tie_word_embeddings,
        reference.max_position_embeddings)
    bigcode, reference = ModelConfig.from_dict({"model_type": "gpt_bigcode", **sizes}), transformers.GPTBigCodeConfig()
    assert (bigcode.hidden_size, bigcode.num_hidden_layers, bigcode.num_attention_heads, bigcode.num_key_value_heads,
            bigcode.context_length) == (reference.n_embd, reference.n_layer, reference.n_head, 1, reference.n_positions)
    assert (bigcode.activation, bigcode.norm_eps, bigcode.tie_word_embeddings) == (
        reference.activation_function, reference.layer_norm_epsilon, reference.tie_word_embeddings)
    falcon, reference = ModelConfig.from_dict({"model_type": "falcon", **sizes}), transformers.FalconConfig()
    assert (falcon.hidden_size, falcon.num_hidden_layers, falcon.num_attention_heads, falcon.num_key_value_heads) == (
        reference.hidden_size, reference.num_hidden_layers, reference.num_attention_heads, 1)  # multi-query
    assert (falcon.intermediate_size, falcon.activation, falcon.qkv_bias, falcon.tie_word_embeddings) == (
        4 * reference.hidden_size, reference.activation, reference.bias, reference.tie_word_embeddings)
    assert falcon.parallel_residual and falcon.shared_block_norm and falcon.rope.theta == 10000.0
    assert falcon.head_dim == reference.head_dim and falcon.norm_eps == reference.layer_norm_epsilon


@pytest.mark.parametrize("raw, message", [
    ({"model_type": "falcon", "alibi": True}, "alibi=true: Falcon's ALiBi position biases"),
    ({"model_type": "falcon", "new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn=false"),
    ({"model_type": "opt", "do_layer_norm_before": False}, "do_layer_norm_before=false"),
    ({"model_type": "opt", "hidden_size": 64, "word_embed_proj_dim": 32}, "word_embed_proj_dim differs"),
    ({"model_type": "opt", "_remove_final_layer_norm": True}, "_remove_final_layer_norm"),
])
def test_a_layout_ferry_does_not_build_is_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({"vocab_size": 100, **raw})


def test_an_opt_checkpoint_without_the_model_prefix_loads(tmp_path):
    """facebook/opt-*'s own checkpoints name their tensors `decoder.layers.0...` (saved from OPTModel)."""
    from safetensors.torch import load_file, save_file
    import shutil
    config_class, extras = FAMILIES["opt"]
    model_dir, _ = save_random_family_model(tmp_path / "opt", config_class(**COMMON, **extras))
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    tensors = load_file(bare / "model.safetensors")
    save_file({name.removeprefix("model."): tensor for name, tensor in tensors.items()}, bare / "model.safetensors")
    assert torch.equal(prefill_logits(load_model(bare), PROMPTS[0]), prefill_logits(load_model(model_dir), PROMPTS[0]))


@pytest.mark.parametrize("model_type", ["glm", "glm4", "helium", "ernie4_5", "seed_oss", "exaone4", "ministral"])
def test_num_key_value_heads_left_out_takes_the_familys_default(model_type):
    """Their configs default to a number of key/value heads of their own, not to num_attention_heads: a config.json
    without the field builds k_proj/v_proj that size in transformers (and in its checkpoint)."""
    reference = transformers.AutoConfig.for_model(model_type, num_attention_heads=160)
    config = ModelConfig.from_dict({"model_type": model_type, "hidden_size": 2560, "intermediate_size": 96,
                                    "num_hidden_layers": 2, "num_attention_heads": 160, "vocab_size": 100})
    assert config.num_key_value_heads == reference.num_key_value_heads != 160
