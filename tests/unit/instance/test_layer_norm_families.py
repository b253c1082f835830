"""LayerNorm decoder families (StarCoder2, StableLM, Phi, GPT-NeoX, GPT-2): greedy tokens equal transformers' on the same random weights
(norms, their biases and the projections' biases random too; a prompt prefilled in chunks; sliding windows
shorter than the sequences), alone and in a busy batch; float32 logits equal transformers' to a tight
tolerance; and the config's fields are read as transformers reads them."""

from __future__ import annotations

import copy
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.instance.engine.context_window import ContextLimit, context_limit
from services.instance.engine.mlp import ACTIVATIONS
from services.instance.engine.model import load_model
from services.instance.engine.model_config import ModelConfig
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.unit.instance.hf_families import (PROMPTS, assert_float32_logits_equal_transformers,
                                             assert_greedy_equals_transformers, prefill_logits, save_random_family_model)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
              initializer_range=0.2)
FAMILIES = {
    # GQA, biases everywhere, a plain gelu_pytorch_tanh MLP, a sliding window, tied embeddings
    "starcoder2": (transformers.Starcoder2Config, dict(num_key_value_heads=2, sliding_window=7)),
    # GQA, q/k/v biases, per-head q/k LayerNorms, attention and MLP in parallel from one norm, a gated MLP
    "stablelm": (transformers.StableLmConfig, dict(num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True,
                                                   use_parallel_residual=True)),
    # one rotated pair of dims per head (partial_rotary_factor 0.125 of 16), sequential blocks
    "stablelm-sequential": (transformers.StableLmConfig, dict(num_key_value_heads=4, partial_rotary_factor=0.125)),
    # attention and a plain gelu_new MLP in parallel from one norm, q/k LayerNorms, biases on the LM head too
    "phi": (transformers.PhiConfig, dict(num_key_value_heads=2, qk_layernorm=True)),
    # the LM head's weight tied to the embeddings, its bias its own
    "phi-tied": (transformers.PhiConfig, dict(tie_word_embeddings=True)),
    # q/k/v fused and interleaved per head, 1/4 of each head rotated (rotary_pct), parallel blocks, two norms
    "gpt_neox": (transformers.GPTNeoXConfig, dict(rotary_pct=0.25, rotary_emb_base=5000)),
    # sequential blocks, half of each head rotated
    "gpt_neox-sequential": (transformers.GPTNeoXConfig, dict(use_parallel_residual=False, rotary_pct=0.5)),
    # learned absolute positions (as many as the longest sequence), Conv1D weights, fused c_attn, tied head
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=3, n_head=4, n_inner=96, n_positions=64)),
}
GPT2_NAMES = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "max_position_embeddings"}  # GPT2Config's are n_embd, n_inner, n_layer, n_head, n_positions
MODEL_TYPES = sorted({config_class.model_type for config_class, _ in FAMILIES.values()})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[pathlib.Path, object]:
    config_class, extras = FAMILIES[request.param]
    common = {k: v for k, v in COMMON.items() if config_class.model_type != "gpt2" or k not in GPT2_NAMES}
    return save_random_family_model(tmp_path_factory.mktemp("models") / f"tiny-{request.param}",
                                    config_class(**common, **extras))


def test_greedy_tokens_equal_transformers_alone_and_batched(family, tmp_path):
    model_dir, hf_model = family
    assert_greedy_equals_transformers(model_dir, hf_model, f"ferry-test-ln-{tmp_path.name}")


def test_float32_logits_equal_transformers(family):
    assert_float32_logits_equal_transformers(*family)


def test_bfloat16_norms_give_transformers_bits(family):
    model_dir, hf_model = family
    ours, theirs = load_model(model_dir, dtype=torch.bfloat16), copy.deepcopy(hf_model).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    base = theirs.base_model
    their_norm = next(getattr(base, name) for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f")
                      if hasattr(base, name))
    layer = base.h[0] if hasattr(base, "h") else base.layers[0]
    their_attention = next(getattr(layer, name) for name in ("self_attn", "attention", "attn") if hasattr(layer, name))
    with torch.no_grad():
        assert torch.equal(ours.norm(x), their_norm(x))
        if getattr(their_attention, "q_layernorm", None) is not None:
            q = torch.randn(16, 4, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            assert torch.equal(ours.layers[0].self_attn.q_norm(q), their_attention.q_layernorm(q))


def test_config_reads_each_familys_fields_as_transformers_does(family):
    model_dir, hf_model = family
    config, theirs = ModelConfig.from_dir(model_dir), hf_model.config
    rope_parameters = getattr(theirs, "rope_parameters", None) or {}
    assert config.layer_norm and config.rope.rotary_dim == config.head_dim * rope_parameters.get(
        "partial_rotary_factor", 1.0)
    if config.model_type == "starcoder2":
        assert config.norm_eps == theirs.norm_epsilon and config.layer_windows == (7, 7, 7)
        assert config.qkv_bias and config.o_bias and config.mlp_bias and not config.gated_mlp
        assert config.tie_word_embeddings and config.activation == "gelu_pytorch_tanh"
    elif config.model_type == "stablelm":
        parallel = theirs.use_parallel_residual
        assert config.norm_eps == theirs.layer_norm_eps and config.gated_mlp and not config.o_bias
        assert (config.qkv_bias, config.qk_norm, config.parallel_residual, config.shared_block_norm) == (
            theirs.use_qkv_bias, theirs.qk_layernorm, parallel, parallel)
    elif config.model_type == "phi":
        assert config.norm_eps == theirs.layer_norm_eps and config.activation == "gelu_new" and config.lm_head_bias
        assert config.qkv_bias and config.o_bias and config.mlp_bias and not config.gated_mlp
        assert config.parallel_residual and config.shared_block_norm and config.qk_norm == theirs.qk_layernorm
    elif config.model_type == "gpt_neox":
        assert config.norm_eps == theirs.layer_norm_eps and config.activation == "gelu" and not config.gated_mlp
        assert config.qkv_bias and config.o_bias and config.mlp_bias and not config.tie_word_embeddings
        assert config.parallel_residual == theirs.use_parallel_residual and not config.shared_block_norm
        assert config.rope.theta == theirs.rope_parameters["rope_theta"]
    elif config.model_type == "gpt2":
        assert config.norm_eps == theirs.layer_norm_epsilon and config.activation == "gelu_new"
        assert config.learned_positions and config.tie_word_embeddings and config.context_length == 64
        assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_key_value_heads) == (
            64, 96, 3, 4)


# transformers' name for each family's norm epsilon
EPS_FIELDS = {"starcoder2": "norm_epsilon", "stablelm": "layer_norm_eps", "phi": "layer_norm_eps",
              "gpt_neox": "layer_norm_eps", "gpt2": "layer_norm_epsilon"}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fields_left_out_take_transformers_defaults(model_type):
    reference = transformers.AutoConfig.for_model(model_type)
    # StableLM's default of 32 key/value heads does not divide 4 heads (test_num_key_value_heads_left_out_...)
    kv_heads = {"num_key_value_heads": 4} if model_type == "stablelm" else {}
    config = ModelConfig.from_dict({"model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, **kv_heads})
    assert config.norm_eps == getattr(reference, EPS_FIELDS[model_type])
    assert config.tie_word_embeddings == reference.tie_word_embeddings
    if model_type != "gpt2":  # no RoPE
        assert config.rope.theta == reference.rope_parameters["rope_theta"]
        assert config.rope.rotary_dim == 16 * reference.rope_parameters.get("partial_rotary_factor", 1.0)
    else:
        assert config.intermediate_size == 4 * 64 and config.context_length == reference.n_positions
    act = getattr(reference, "hidden_act", None) or reference.activation_function
    assert config.activation == act


def test_gelu_new_gives_transformers_bits():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(6))
    assert torch.equal(ACTIVATIONS["gelu_new"](x), transformers.activations.ACT2FN["gelu_new"](x))


@pytest.mark.parametrize("raw, rotary_dim, theta", [
    ({"model_type": "gpt_neox", "rotary_pct": 0.5, "rotary_emb_base": 20000}, 8, 20000.0),  # Pythia's config.json
    ({"model_type": "gpt_neox"}, 4, 10000.0),
    ({"model_type": "stablelm", "num_key_value_heads": 4, "partial_rotary_factor": 0.5, "rope_theta": 5000}, 8, 5000.0),
    ({"model_type": "phi", "partial_rotary_factor": 0.25}, 4, 10000.0),
])
def test_the_old_spelling_of_partial_rotary_and_theta_is_read(raw, rotary_dim, theta):
    sizes = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100}
    rope = ModelConfig.from_dict({**sizes, **raw}).rope
    assert (rope.rotary_dim, rope.theta) == (rotary_dim, theta)


@pytest.mark.parametrize("model_type, num_kv_heads, head_dim", [
    ("gpt_neox", 4, 16), ("stablelm", 2, 16), ("phi", 2, 8), ("starcoder2", 2, 8)])
def test_head_fields_are_read_where_transformers_reads_them(model_type, num_kv_heads, head_dim):
    """Found writing the end-to-end test: GPT-NeoX has no GQA and, like StableLM, takes head_dim from
    hidden_size, whatever config.json says (transformers writes such fields back where they were given)."""
    config = ModelConfig.from_dict({"model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                                    "num_key_value_heads": 2, "head_dim": 8})
    assert (config.num_key_value_heads, config.head_dim) == (num_kv_heads, head_dim)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_a_gpt2_checkpoint_without_the_transformer_prefix_loads(family, tmp_path):
    """openai-community/gpt2's own checkpoint names its tensors `h.0.attn.c_attn.weight`, `wte.weight`, ..."""
    model_dir, _ = family
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    tensors = load_file(bare / "model.safetensors")
    save_file({name.removeprefix("transformer."): tensor for name, tensor in tensors.items()}, bare / "model.safetensors")
    assert torch.equal(prefill_logits(load_model(bare), PROMPTS[0]), prefill_logits(load_model(model_dir), PROMPTS[0]))


def test_gpt2_settings_are_read_or_refused():
    raw = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 100}
    assert ModelConfig.from_dict({**raw, "scale_attn_weights": False}).attention_scale == 1.0
    assert ModelConfig.from_dict(raw).attention_scale is None  # head_dim ** -0.5
    assert context_limit(raw) == ContextLimit(128, "max_position_embeddings")  # what the frontend serves
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        ModelConfig.from_dict({**raw, "scale_attn_by_inverse_layer_idx": True})


@pytest.mark.parametrize("model_type, num_heads, num_kv_heads", [("starcoder2", 4, 2), ("stablelm", 64, 32)])
def test_num_key_value_heads_left_out_takes_the_familys_default(model_type, num_heads, num_kv_heads):
    """StarCoder2's config defaults to 2 key/value heads and StableLM's to 32, not to num_attention_heads:
    a config.json without the field builds k_proj/v_proj that size in transformers (and in its checkpoint)."""
    reference = transformers.AutoConfig.for_model(model_type, num_attention_heads=num_heads)
    config = ModelConfig.from_dict({"model_type": model_type, "hidden_size": 512, "intermediate_size": 96,
                                    "num_hidden_layers": 2, "num_attention_heads": num_heads, "vocab_size": 100})
    assert config.num_key_value_heads == reference.num_key_value_heads == num_kv_heads


def test_a_gpt2_config_without_n_positions_has_the_same_limit_in_the_frontend_and_the_engine():
    """The frontend reads config.json as it is (context_limit); the engine after GPT-2's names are mapped: both take
    GPT2Config's default of 1024 positions (the rows of `wpe`), not the 2048 of configs without max_position_embeddings."""
    raw = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}
    assert context_limit(raw).length == ModelConfig.from_dict(raw).context_length == transformers.GPT2Config().n_positions
