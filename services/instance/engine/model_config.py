"""The model's shape, read from a Hugging Face `config.json`.

Llama-family decoders are supported (pre-norm blocks, RoPE, GQA, gated MLP), each
`model_type` with its own extras, as transformers runs them:

* "llama"; "mistral";
* "qwen2" (biases on q/k/v, none on o); "qwen3" (an RMSNorm over each query and key head
  before RoPE);
* "phi3" (q/k/v and gate/up fused in the checkpoint; partial rotary and longrope RoPE);
* "gemma" (GeGLU, norms scaling by 1 + weight, embeddings scaled by sqrt(hidden_size));
  "gemma2" (besides: norms after attention and after the MLP too, tanh soft-capping of the
  attention scores and of the logits, `query_pre_attn_scalar`, sliding window on alternate layers);
  "gemma3_text" (Gemma 3 text-only checkpoints: as Gemma 2 without soft-capping, with a
  Gemma-style RMSNorm over each query and key head, and a RoPE of their own on the sliding
  layers);
* "granite" (embedding, residual, attention and logits multipliers);
* "smollm3" (no RoPE on the layers `no_rope_layers` marks 0, by default every `no_rope_layer_interval`-th;
  with `use_sliding_window`, a sliding window on the layers `layer_types` marks, by default the NoPE ones);
* "olmo2" (norms after attention and after the MLP only, none before; an RMSNorm over all
  query heads together and one over all key heads, before RoPE);
* mixture-of-experts MLPs: "mixtral" (Mistral's attention), "qwen2_moe" (Qwen2's, plus a
  shared expert every token takes, gated by a sigmoid), "qwen3_moe" (Qwen3's) and "olmoe"
  (OLMo2's query and key norms with pre-norm blocks, and `clip_qkv`), each token through its
  top k experts (MoeConfig).

LayerNorm families (LayerNorms with a bias instead of RMSNorms):

* "starcoder2" (biases on every projection with `use_bias`, a plain MLP `c_fc` → act → `c_proj`,
  `norm_epsilon`, a sliding window on every layer, embeddings tied by default);
* "stablelm" (a gated MLP; partial rotary, 1/4 of each head by default; q/k/v biases with
  `use_qkv_bias`; with `qk_layernorm` a LayerNorm over each query and key head, each head its own
  weights; with `use_parallel_residual` attention and MLP read the same normed input, added together);
* "phi" (Phi-1/1.5/2: attention and a plain `fc1` → gelu_new → `fc2` MLP read the same normed input,
  added together; partial rotary, half of each head by default; biases on every projection and the
  LM head; with `qk_layernorm` a LayerNorm over each query and key head; `final_layernorm`);
* "gpt_neox" (Pythia: q/k/v fused in the checkpoint, interleaved per head; `rotary_pct` of each
  head rotated, 1/4 by default, with base `rotary_emb_base`; attention and a plain
  `dense_h_to_4h` → gelu → `dense_4h_to_h` MLP in parallel (`use_parallel_residual`), each from its
  own norm; biases on every projection with `attention_bias`; the LM head `embed_out`);
* "gpt2" (learned absolute position embeddings `wpe` instead of RoPE, served up to `n_positions`;
  Conv1D weights stored transposed; q/k/v fused in `c_attn`; a plain `c_fc` → gelu_new → `c_proj`
  MLP; biases everywhere; embeddings tied by default; `scale_attn_weights`); "gpt_bigcode" (StarCoder 1: the same in
  Linear weights, a gelu_pytorch_tanh MLP, one key/value head with `multi_query`);
* "gptj" (GPT-2's field names; attention and a plain `fc_in` → gelu_new → `fc_out` MLP from one norm; RoPE of base
  10000 over the first `rotary_dim` dims of each head, in adjacent pairs; no attention biases; a biased LM head);
* "opt" (learned positions, row p + 2 for position p; a plain `fc1` → relu → `fc2` MLP of `ffn_dim`; biases with
  `enable_bias`; norms without parameters with `layer_norm_elementwise_affine` false; the post-norm and
  projected-embedding layouts of OPT-350m refused);
* "falcon" (q/k/v fused in `query_key_value`, grouped by key/value head: `num_kv_heads` with
  `new_decoder_architecture`, else one with `multi_query`, else one per query head; parallel blocks from one norm,
  or from `ln_attn` and `ln_mlp` in the new architecture, or sequential ones without `parallel_attn`; `bias`; ALiBi
  refused);
* "olmo" (the first OLMo: Llama's blocks with LayerNorms without weight or bias, `clip_qkv`);
* "cohere" (Command-R: attention and a gated MLP from one LayerNorm without bias, added in that order; RoPE in
  adjacent pairs; logits multiplied by `logit_scale`; with `use_qk_norm` a LayerNorm over each query and key head);
  "cohere2" (besides: a sliding window on three layers of four, and no RoPE on the others);
* Llamas with RoPE in adjacent pairs ("helium": norms scaling in float32; "ernie4_5": biases everywhere with
  `use_bias`; "glm": half of each head rotated, q/k/v biases, gate/up fused in the checkpoint; "glm4": besides, Gemma
  2's norms around attention and the MLP) or other biases ("seed_oss": `attention_out_bias`);
* "exaone4" (OLMo2's norms after attention and after the MLP only, with Llama's rounding; an RMSNorm over each query
  and key head before RoPE; with a `sliding_window`, three sliding layers in four and no RoPE on the others);
* "hunyuan_v1_dense" (an RMSNorm over each query and key head after RoPE; NTK `alpha` stretching the RoPE base);
* "ministral" (Mistral's attention, the window on the layers `layer_types` marks);
* "olmo3" (OLMo2's blocks with a sliding window on three layers of four, which rotate by a RoPE of their own:
  the same base, no scaling); "arcee" (AFM: a plain `up_proj` → relu2 → `down_proj` MLP).

Sliding windows are read per layer, and longrope RoPE limits the longest sequence served
(context_window.py); RoPE settings are read in rope.py.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.config import path_shown
from services.instance.engine.context_window import ContextLimit, context_limit, layer_windows, max_positions
from services.instance.engine.rope import RopeConfig, nope_layers, read_layer_ropes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text",
                         "granite", "smollm3", "glm", "glm4", "helium", "ernie4_5", "seed_oss", "exaone4",
                         "hunyuan_v1_dense", "arcee", "olmo2", "olmo3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                         "starcoder2", "stablelm", "phi", "gpt_neox", "gpt2", "gpt_bigcode", "gptj", "opt", "falcon",
                         "olmo", "cohere", "cohere2")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# LayerNorms instead of RMSNorms (with a bias, but OLMo's have no parameters at all and Cohere's no bias)
LAYER_NORM_TYPES = ("starcoder2", "stablelm", "phi", "gpt_neox", "gpt2", "gpt_bigcode", "gptj", "opt", "falcon", "olmo",
                    "cohere", "cohere2")
GPT2_TYPES = ("gpt2", "gpt_bigcode")  # GPT-2's layout: learned positions `wpe`, q/k/v fused in `c_attn`
COHERE_TYPES = ("cohere", "cohere2")
# RoPE over adjacent pairs of dims (2i, 2i + 1), not over halves (i, i + rotary_dim / 2)
INTERLEAVED_ROPE_TYPES = (*COHERE_TYPES, "gptj", "glm", "glm4", "helium", "ernie4_5")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2")  # the MLP's act
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse MLP: a router's softmax picks each token's top `top_k` of `num_experts` gated MLPs,
    whose outputs are summed weighted by their router probabilities."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # the top k weights are divided by their sum (Mixtral always; Qwen: norm_topk_prob)
    rounds_weights: bool  # the router's weights are rounded to the model's dtype (Qwen) or stay float32 (Mixtral)
    shared_intermediate_size: int  # Qwen2-MoE: a shared expert every token takes, gated by a sigmoid; 0 = none
    sparse_layers: tuple[bool, ...]  # per layer: the sparse MLP (True) or a dense one of intermediate_size


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float  # rms_norm_eps, or the LayerNorm families' norm_epsilon / layer_norm_eps
    rope: RopeConfig  # of the full-attention layers
    sliding_rope: RopeConfig | None  # of the sliding-window layers, if they differ (Gemma 3)
    max_position_embeddings: int
    context: ContextLimit  # the longest sequence served: max_position_embeddings, or less (context_window.py)
    layer_windows: tuple[int | None, ...]  # each layer's sliding window in tokens; None: the whole context
    tie_word_embeddings: bool  # the LM head reuses the embedding matrix
    qkv_bias: bool  # q/k/v projections carry a bias
    o_bias: bool  # the output projection carries a bias
    qk_norm: bool  # an RMSNorm (head_dim wide) over each query and key head before RoPE
    qk_norm_full: bool  # OLMo2, OLMoE: an RMSNorm over all query heads together, one over all key heads
    mlp_bias: bool  # gate/up/down projections carry a bias
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos_token_id, int or list, as a tuple
    torch_dtype: str  # the dtype the checkpoint was saved in, e.g. "bfloat16"
    activation: str = "silu"  # one of SUPPORTED_ACTIVATIONS
    norm_weight_offset: float = 0.0  # Gemma: the norms scale by (offset + weight)
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: each block's output is scaled by it before the residual add
    attention_scale: float | None = None  # Granite: attention_multiplier; None: head_dim ** -0.5
    logits_divisor: float = 1.0  # Granite: logits_scaling
    attention_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap) before the softmax
    logits_softcap: float | None = None  # Gemma 2: the same on the logits
    sandwich_norms: bool = False  # Gemma 2: attention and MLP outputs are normed too before the residual add
    post_norms_only: bool = False  # OLMo2: attention and MLP outputs are normed before the residual add, inputs not
    norm_scales_in_float32: bool = False  # OLMo2: each norm scales by its weight in float32, then casts
    clip_qkv: float | None = None  # OLMoE: queries, keys and values are clamped to [-clip_qkv, clip_qkv]
    moe: MoeConfig | None = None  # Mixtral, Qwen2/3-MoE: the layers' sparse MLPs
    layer_norm: bool = False  # LAYER_NORM_TYPES: the norms are LayerNorms with a bias (norm_eps), not RMSNorms
    gated_mlp: bool = True  # down(act(gate(x)) * up(x)); False: a plain MLP down(act(up(x))) (StarCoder2, Phi, NeoX)
    qk_norm_per_head_weights: bool = False  # StableLM: with qk_norm, each head's LayerNorm its own weights, no bias
    parallel_residual: bool = False  # attention and MLP both read the block's input; both outputs added to it
    shared_block_norm: bool = False  # StableLM, Phi: with parallel_residual, one norm (input_layernorm) feeds both
    parallel_adds_attention_first: bool = False  # StableLM: (h + attn) + mlp; else h + (attn + mlp) (other rounding)
    lm_head_bias: bool = False  # Phi: the LM head carries a bias (its own head, even where its weight is tied)
    learned_positions: bool = False  # GPT-2: learned absolute position embeddings added to the tokens'; no RoPE
    nope_layers: tuple[bool, ...] = ()  # SmolLM3, Cohere 2: per layer, True where it skips RoPE (NoPE); (): none does
    rope_interleaved: bool = False  # Cohere, GPT-J: RoPE rotates adjacent pairs of dims (q/k rows permuted at load)
    norm_affine: bool = True  # False: OLMo's LayerNorms have neither weight nor bias
    norm_bias: bool = True  # with layer_norm: False where the LayerNorms have a weight only (Cohere)
    logits_scale: float = 1.0  # Cohere: logit_scale, multiplying the logits
    qk_norm_after_rope: bool = False  # Hunyuan: with qk_norm, each query and key head is normed after RoPE

    @property
    def context_length(self) -> int:
        return self.context.length

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE to its queries and keys."""
        return not self.learned_positions and not (self.nope_layers and self.nope_layers[layer])

    @property
    def has_fused_checkpoint(self) -> bool:
        """Phi-3 checkpoints hold q/k/v and gate/up already fused; GPT-2's q/k/v; GPT-NeoX's and Falcon's, grouped
        per head (weights.py)."""
        return self.model_type in ("phi3", "gpt_neox", "gpt2", "gpt_bigcode", "falcon")

    @property
    def has_fused_gate_up(self) -> bool:
        """Phi-3's and GLM's checkpoints hold gate/up fused in `gate_up_proj`."""
        return self.model_type in ("phi3", "glm", "glm4")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {path_shown(model_dir)}: pass --model a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = _model_type(raw)
        if model_type in (*GPT2_TYPES, "gptj"):
            raw = _gpt2_fields(raw)
        if model_type == "opt":
            raw = _opt_fields(raw)
        if model_type == "falcon":
            raw = _falcon_fields(raw)
        for name, why in _UNSUPPORTED_FIELDS.items():
            if raw.get(name):
                raise ValueError(f"config.json: {name}: {why}")
        num_heads = _required_int(raw, "num_attention_heads")
        hidden_size = _required_int(raw, "hidden_size")
        num_kv_heads = num_heads if model_type in _MHA_ONLY else int(
            raw.get("num_key_value_heads") or _DEFAULT_KV_HEADS.get(model_type, num_heads))
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or _DEFAULT_HEAD_DIMS.get(model_type) or hidden_size // num_heads)
        if model_type in ("stablelm", "cohere2", "falcon", *_MHA_ONLY):  # transformers ignores their head_dim
            head_dim = hidden_size // num_heads
        rope, sliding_rope = read_layer_ropes(raw, head_dim)
        num_layers = _required_int(raw, "num_hidden_layers")
        windows = layer_windows(raw, num_layers)
        return cls(
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_required_int(raw, "vocab_size"),
            norm_eps=_norm_eps(raw, model_type),
            rope=rope,
            sliding_rope=sliding_rope,
            max_position_embeddings=max_positions(raw),
            context=context_limit(raw),
            layer_windows=windows,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4", "hunyuan_v1_dense") or bool(
                model_type in ("stablelm", "phi") and raw.get("qk_layernorm")) or _cohere_qk_norm(raw),
            qk_norm_full=model_type in ("olmo2", "olmo3", "olmoe"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=_dtype_name(raw),
            activation=_activation(raw, model_type),
            moe=_moe(raw, model_type, num_layers),
            post_norms_only=model_type in ("olmo2", "olmo3", "exaone4"),
            qk_norm_after_rope=model_type == "hunyuan_v1_dense",
            clip_qkv=_clip_qkv(raw, model_type),
            nope_layers=nope_layers(raw, windows),
            rope_interleaved=model_type in INTERLEAVED_ROPE_TYPES,
            norm_scales_in_float32=model_type in ("olmo2", "olmo3", "helium"),
            **_biases(raw, model_type),
            **_block_layout(raw, model_type),
            **_scales(raw, model_type, hidden_size),
        )


# transformers' per-family defaults for fields a config.json may leave out
_DEFAULT_HEAD_DIMS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256, "glm": 128, "glm4": 128,
                      "helium": 128, "ernie4_5": 128, "seed_oss": 128}
_DEFAULT_KV_HEADS = {"starcoder2": 2, "stablelm": 32, "glm": 2, "glm4": 2, "helium": 20, "ernie4_5": 2,
                     "seed_oss": 8, "exaone4": 32, "ministral": 8}  # else num_attention_heads
_DEFAULT_RMS_NORM_EPS = {"phi3": 1e-5, "mixtral": 1e-5, "olmo2": 1e-5, "olmo3": 1e-5, "olmoe": 1e-5, "arcee": 1e-5, "glm": 1.5625e-07,
                         "glm4": 1.5625e-07, "helium": 1e-8, "ernie4_5": 1e-5,
                         "exaone4": 1e-5, "hunyuan_v1_dense": 1e-5}
_NORM_EPS_FIELDS = {"starcoder2": "norm_epsilon", "stablelm": "layer_norm_eps", "phi": "layer_norm_eps",
                    "gpt_neox": "layer_norm_eps", "gpt2": "layer_norm_epsilon", "gptj": "layer_norm_epsilon",
                    "gpt_bigcode": "layer_norm_epsilon",
                    "falcon": "layer_norm_epsilon",
                    "cohere": "layer_norm_eps", "cohere2": "layer_norm_eps",
                    "olmo": None, "opt": None}  # OLMo's and OPT's are 1e-5, whatever config.json says
_MHA_ONLY = ("gpt_neox", "gpt2", "gptj", "opt")  # no grouped-query attention: num_key_value_heads is ignored  # the LayerNorm families' name for it (default 1e-5)
_DEFAULT_ACTIVATIONS = {"gemma": "gelu_pytorch_tanh", "starcoder2": "gelu_pytorch_tanh", "phi": "gelu_new",
                        "gpt_neox": "gelu", "falcon": "gelu", "arcee": "relu2"}  # else silu
_TIED_BY_DEFAULT = (*GEMMA_TYPES, "starcoder2", *GPT2_TYPES, "opt", "falcon", "smollm3", "ernie4_5", *COHERE_TYPES)
# transformers' names for the same functions (FastGELUActivation is a tanh approximation; swish is SiLU)
_ACTIVATION_ALIASES = {"gelu_fast": "gelu_pytorch_tanh", "swish": "silu"}
# Fields that change the computation in ways this engine does not implement: refused by name.
_UNSUPPORTED_FIELDS = {
    "quantization_config": "quantized checkpoints are not supported (their weights would be read as plain "
                           "numbers, without their scales); use an unquantized checkpoint",
    "use_bidirectional_attention": "bidirectional (encoder) attention is not supported; ferry serves causal "
                                   "decoders",
}


def _model_type(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; "
            f"the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _required_int(raw: dict[str, Any], field: str) -> int:
    value = raw.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json: {field} must be a positive integer, got {value!r}")
    return value




def _activation(raw: dict[str, Any], model_type: str) -> str:
    if model_type in ("gemma2", "gemma3_text"):  # transformers reads hidden_activation only
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        act = raw.get("hidden_act") or _DEFAULT_ACTIVATIONS.get(model_type, "silu")
    if model_type == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers reads Gemma's legacy "gelu" as the tanh approximation
    act = _ACTIVATION_ALIASES.get(act, act)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; use one of "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return act


def _norm_eps(raw: dict[str, Any], model_type: str) -> float:
    if model_type in LAYER_NORM_TYPES:
        field = _NORM_EPS_FIELDS[model_type]
        return float(raw.get(field, 1e-5)) if field else 1e-5
    return float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS.get(model_type, 1e-6)))


def _biases(raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Which projections carry a bias, as each family's transformers code builds them."""
    if model_type == "starcoder2":
        bias = bool(raw.get("use_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}
    if model_type == "stablelm":
        return {"qkv_bias": bool(raw.get("use_qkv_bias", False)), "o_bias": False, "mlp_bias": False}
    if model_type == "phi":
        return {"qkv_bias": True, "o_bias": True, "mlp_bias": True, "lm_head_bias": True}
    if model_type == "gpt_neox":
        bias = bool(raw.get("attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": True}
    if model_type in GPT2_TYPES:
        return {"qkv_bias": True, "o_bias": True, "mlp_bias": True}
    if model_type == "gptj":  # attention without biases, the MLP and the LM head with
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": True, "lm_head_bias": True}
    if model_type == "falcon":
        bias = bool(raw.get("bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}
    if model_type == "opt":
        bias = bool(raw.get("enable_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}
    attention_bias = bool(raw.get("attention_bias", model_type in ("glm", "glm4", "seed_oss")))
    if model_type in ("exaone4", "ministral"):  # no biases at all, whatever the config says
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
    if model_type in ("olmo", "hunyuan_v1_dense", *COHERE_TYPES):  # their MLPs have no biases, whatever mlp_bias says
        return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": False}
    if model_type in ("glm", "glm4", "helium", "seed_oss"):  # q/k/v biases only (Seed-OSS: o's its own switch)
        return {"qkv_bias": attention_bias, "o_bias": bool(raw.get("attention_out_bias", False)),
                "mlp_bias": model_type != "glm" and model_type != "glm4" and bool(raw.get("mlp_bias", False))}
    if model_type == "ernie4_5":
        bias = bool(raw.get("use_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}
    return {"qkv_bias": _qkv_bias(raw, model_type, attention_bias),
            "o_bias": model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            "mlp_bias": bool(raw.get("mlp_bias", False))}


def _block_layout(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The LayerNorm families' norms and MLPs (ModelConfig's fields from layer_norm on)."""
    if model_type == "glm4":  # Gemma 2's norms around attention and the MLP, named otherwise (weights.py)
        return {"sandwich_norms": True}
    if model_type == "arcee":  # a plain up -> relu2 -> down MLP
        return {"gated_mlp": False}
    if model_type not in LAYER_NORM_TYPES:
        return {}
    if model_type == "stablelm":
        parallel = bool(raw.get("use_parallel_residual", False))
        return {"layer_norm": True, "qk_norm_per_head_weights": bool(raw.get("qk_layernorm")),
                "parallel_residual": parallel, "shared_block_norm": parallel, "parallel_adds_attention_first": True}
    if model_type == "phi":
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": True, "shared_block_norm": True}
    if model_type == "olmo":  # Llama's blocks and MLP; LayerNorms without parameters
        return {"layer_norm": True, "norm_affine": False}
    if model_type in COHERE_TYPES:  # attention and MLP from one norm (a LayerNorm without bias), added in that order
        return {"layer_norm": True, "norm_bias": False, "parallel_residual": True, "shared_block_norm": True,
                "parallel_adds_attention_first": True, "qk_norm_per_head_weights": _cohere_qk_norm(raw)}
    if model_type == "gptj":  # attention and a plain MLP from one norm
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": True, "shared_block_norm": True}
    if model_type == "opt":  # learned positions, Llama's blocks with a plain MLP
        return {"layer_norm": True, "gated_mlp": False, "learned_positions": True,
                "norm_affine": bool(raw.get("layer_norm_elementwise_affine", True))}
    if model_type == "falcon":  # parallel blocks from one norm, or (falcon_two_norms) each half its own
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": bool(raw["parallel_attn"]),
                "shared_block_norm": bool(raw["parallel_attn"]) and not _falcon_two_norms(raw)}
    if model_type == "gpt_neox":  # parallel blocks by default, each half its own norm
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": bool(raw.get("use_parallel_residual", True))}
    return {"layer_norm": True, "gated_mlp": False, "learned_positions": model_type in GPT2_TYPES}


def _clip_qkv(raw: dict[str, Any], model_type: str) -> float | None:
    """OLMo, OLMoE: queries, keys and values are clamped to [-clip_qkv, clip_qkv]."""
    return float(raw["clip_qkv"]) if model_type in ("olmo", "olmoe") and raw.get("clip_qkv") is not None else None


def _cohere_qk_norm(raw: dict[str, Any]) -> bool:
    """Cohere's use_qk_norm (Command R+): a LayerNorm without bias over each query and key head, each its own
    weights."""
    return raw.get("model_type") == "cohere" and bool(raw.get("use_qk_norm"))


# GPT2Config's and GPTJConfig's sizes where config.json has none
_GPT_DEFAULTS = {"gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12, "activation_function": "gelu_new"},
                 "gpt_bigcode": {"n_embd": 768, "n_layer": 12, "n_head": 12,
                                 "activation_function": "gelu_pytorch_tanh"},
                 "gptj": {"n_embd": 4096, "n_layer": 28, "n_head": 16, "activation_function": "gelu_new"}}


def _gpt2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's, GPT-BigCode's and GPT-J's config.json under the names the other families use (as transformers'
    config classes map them; GPT-BigCode: one key/value head with multi_query); the settings this engine does not
    implement refused by name."""
    if raw.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("config.json: scale_attn_by_inverse_layer_idx: a score scale per layer is not supported")
    defaults = _GPT_DEFAULTS[raw["model_type"]]

    def read(name: str, llama_name: str) -> Any:
        return raw.get(name, raw.get(llama_name, defaults[name]))

    hidden_size = read("n_embd", "hidden_size")
    return {**raw, "hidden_size": hidden_size, "num_hidden_layers": read("n_layer", "num_hidden_layers"),
            "num_attention_heads": read("n_head", "num_attention_heads"), "max_position_embeddings": max_positions(raw),
            "intermediate_size": raw.get("n_inner") or 4 * hidden_size,
            "hidden_act": raw.get("activation_function", defaults["activation_function"]),
            **({"num_key_value_heads": 1 if raw.get("multi_query", True) else read("n_head", "num_attention_heads")}
               if raw["model_type"] == "gpt_bigcode" else {})}


def _opt_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """OPT's config.json under the other families' names; its post-norm (OPT-350m) and projected-embedding layouts
    refused by name."""
    hidden_size = raw.get("hidden_size", 768)
    if not raw.get("do_layer_norm_before", True):
        raise ValueError("config.json: do_layer_norm_before=false: OPT's post-norm blocks (OPT-350m) are not supported")
    if raw.get("word_embed_proj_dim", hidden_size) != hidden_size:
        raise ValueError("config.json: word_embed_proj_dim differs from hidden_size: OPT's projected embeddings "
                         "(project_in/project_out) are not supported")
    if raw.get("_remove_final_layer_norm"):
        raise ValueError("config.json: _remove_final_layer_norm: OPT without its final LayerNorm is not supported")
    return {**raw, "intermediate_size": raw.get("ffn_dim", 3072), "hidden_act": raw.get("activation_function", "relu"),
            "hidden_size": hidden_size, "num_hidden_layers": raw.get("num_hidden_layers", 12),
            "num_attention_heads": raw.get("num_attention_heads", 12)}  # OPTConfig's defaults


def _falcon_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config.json under the other families' names (its key/value heads: `num_kv_heads` with
    new_decoder_architecture, else 1 with multi_query, else one per query head); ALiBi refused."""
    if raw.get("alibi"):
        raise ValueError("config.json: alibi=true: Falcon's ALiBi position biases (Falcon-RW) are not supported; "
                         "ferry serves the rotary Falcons")
    hidden_size = raw.get("n_embed") or raw.get("hidden_size", 4544)
    num_heads = raw.get("num_attention_heads", raw.get("n_head", 71))
    new_architecture, parallel = bool(raw.get("new_decoder_architecture")), bool(raw.get("parallel_attn", True))
    if new_architecture and not parallel:
        raise ValueError("config.json: parallel_attn=false with new_decoder_architecture: transformers cannot run "
                         "this config either")
    kv_heads = (raw.get("num_kv_heads") or num_heads) if new_architecture else \
        1 if raw.get("multi_query", True) else num_heads
    return {**raw, "hidden_size": hidden_size, "num_attention_heads": num_heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": raw.get("num_hidden_layers", raw.get("n_layer", 32)),
            "intermediate_size": raw.get("ffn_hidden_size") or 4 * hidden_size,
            "hidden_act": raw.get("activation", "gelu"), "parallel_attn": parallel,
            "new_decoder_architecture": new_architecture}


def _falcon_two_norms(raw: dict[str, Any]) -> bool:
    """Falcon's new decoder architecture norms attention's and the MLP's input apart (`ln_attn`, `ln_mlp`) unless
    num_ln_in_parallel_attn is 1 (Falcon 2)."""
    return bool(raw.get("new_decoder_architecture")) and raw.get("num_ln_in_parallel_attn") in (None, 2)


def _qkv_bias(raw: dict[str, Any], model_type: str, attention_bias: bool) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias says otherwise; the rest with attention_bias."""
    return model_type == "qwen2" or attention_bias or (model_type == "qwen2_moe" and bool(raw.get("qkv_bias", True)))


def _moe(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The sparse MLPs of a mixture-of-experts family (transformers' defaults for fields left out)."""
    if model_type not in MOE_TYPES:
        return None
    read = {"mixtral": _mixtral_experts, "olmoe": _olmoe_experts}.get(model_type, _qwen_experts)
    moe = read(raw, model_type, num_layers)
    if any(moe.sparse_layers) and not 0 < moe.top_k <= moe.num_experts:
        raise ValueError(f"config.json: num_experts_per_tok={moe.top_k} must be between 1 and the number of "
                         f"experts ({moe.num_experts})")
    return moe


def _mixtral_experts(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig:
    """Every layer sparse; the top k always renormalized, their weights kept in float32."""
    return MoeConfig(num_experts=_num_experts(raw, 8), top_k=int(raw.get("num_experts_per_tok", 2)),
                     expert_intermediate_size=_required_int(raw, "intermediate_size"), renormalize=True,
                     rounds_weights=False, shared_intermediate_size=0, sparse_layers=(True,) * num_layers)


def _olmoe_experts(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig:
    """Every layer sparse, experts of intermediate_size."""
    return MoeConfig(num_experts=_num_experts(raw, 64), top_k=int(raw.get("num_experts_per_tok", 8)),
                     expert_intermediate_size=_required_int(raw, "intermediate_size"),
                     renormalize=bool(raw.get("norm_topk_prob", False)), rounds_weights=True,
                     shared_intermediate_size=0, sparse_layers=(True,) * num_layers)


def _qwen_experts(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig:
    """Sparse layers by decoder_sparse_step less mlp_only_layers; Qwen2-MoE's shared expert."""
    if raw.get("use_sliding_window"):
        raise ValueError(f"config.json: use_sliding_window: sliding windows are not supported for {model_type}")
    is_qwen2 = model_type == "qwen2_moe"
    num_experts = _num_experts(raw, 60 if is_qwen2 else 128)
    dense_layers = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ValueError(f"config.json: decoder_sparse_step must be a positive integer, got {step}")
    return MoeConfig(
        num_experts=num_experts, top_k=int(raw.get("num_experts_per_tok", 4 if is_qwen2 else 8)),
        expert_intermediate_size=_required_int(raw, "moe_intermediate_size"),
        renormalize=bool(raw.get("norm_topk_prob", False)), rounds_weights=True,
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 5632)) if is_qwen2 else 0,
        sparse_layers=tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
                            for i in range(num_layers)))


def _num_experts(raw: dict[str, Any], default: int) -> int:
    """Qwen's checkpoints say num_experts, Mixtral's num_local_experts; transformers 5 writes the latter for all
    (and reads it first where both are given)."""
    return int(raw.get("num_local_experts", raw.get("num_experts", default)))


def _scales(raw: dict[str, Any], model_type: str, hidden_size: int) -> dict[str, Any]:
    """The family's constant factors (ModelConfig's fields from norm_weight_offset on)."""
    if model_type == "gemma":
        return {"norm_weight_offset": 1.0, "embedding_scale": math.sqrt(hidden_size)}
    if model_type in GPT2_TYPES and not raw.get("scale_attn_weights", True):
        return {"attention_scale": 1.0}
    if model_type in ("gemma2", "gemma3_text"):
        softcaps = (50.0, 30.0) if model_type == "gemma2" else (None, None)  # transformers' defaults
        # Gemma 3 keeps attn_logit_softcapping in its config, but transformers never applies it.
        attention_softcap = raw.get("attn_logit_softcapping", softcaps[0]) if model_type == "gemma2" else None
        return {"norm_weight_offset": 1.0, "embedding_scale": math.sqrt(hidden_size),
                "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                "attention_softcap": attention_softcap,
                "logits_softcap": raw.get("final_logit_softcapping", softcaps[1]), "sandwich_norms": True}
    if model_type in COHERE_TYPES:
        return {"logits_scale": float(raw.get("logit_scale", 0.0625))}
    if model_type == "granite":
        return {"embedding_scale": float(raw.get("embedding_multiplier", 1.0)),
                "residual_scale": float(raw.get("residual_multiplier", 1.0)),
                "attention_scale": float(raw.get("attention_multiplier", 1.0)),
                "logits_divisor": float(raw.get("logits_scaling", 1.0))}
    return {}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype_name(raw: dict[str, Any]) -> str:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json: torch_dtype={name!r} is not supported; use one of {', '.join(DTYPES)}")
    return name
