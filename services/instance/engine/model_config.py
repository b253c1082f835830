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
  MLP; biases everywhere; embeddings tied by default; `scale_attn_weights`).

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
from services.instance.engine.rope import RopeConfig, read_layer_ropes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite",
                         "olmo2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "starcoder2", "stablelm", "phi", "gpt_neox", "gpt2")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
LAYER_NORM_TYPES = ("starcoder2", "stablelm", "phi", "gpt_neox", "gpt2")  # LayerNorms with a bias instead of RMSNorms
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")  # the MLP's act
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

    @property
    def context_length(self) -> int:
        return self.context.length

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_fused_checkpoint(self) -> bool:
        """Phi-3 checkpoints hold q/k/v and gate/up already fused; GPT-2's q/k/v; GPT-NeoX's, interleaved per head."""
        return self.model_type in ("phi3", "gpt_neox", "gpt2")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {path_shown(model_dir)}: pass --model a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = _model_type(raw)
        if model_type == "gpt2":
            raw = _gpt2_fields(raw)
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
        if model_type in ("stablelm", *_MHA_ONLY):  # transformers ignores head_dim (and these num_key_value_heads)
            head_dim = hidden_size // num_heads
        rope, sliding_rope = read_layer_ropes(raw, head_dim)
        return cls(
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=_required_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_required_int(raw, "vocab_size"),
            norm_eps=_norm_eps(raw, model_type),
            rope=rope,
            sliding_rope=sliding_rope,
            max_position_embeddings=max_positions(raw),
            context=context_limit(raw),
            layer_windows=layer_windows(raw, _required_int(raw, "num_hidden_layers")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text") or bool(
                model_type in ("stablelm", "phi") and raw.get("qk_layernorm")),
            qk_norm_full=model_type in ("olmo2", "olmoe"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=_dtype_name(raw),
            activation=_activation(raw, model_type),
            moe=_moe(raw, model_type, _required_int(raw, "num_hidden_layers")),
            post_norms_only=model_type == "olmo2",
            norm_scales_in_float32=model_type == "olmo2",
            clip_qkv=float(raw["clip_qkv"]) if model_type == "olmoe" and raw.get("clip_qkv") is not None else None,
            **_biases(raw, model_type),
            **_block_layout(raw, model_type),
            **_scales(raw, model_type, hidden_size),
        )


# transformers' per-family defaults for fields a config.json may leave out
_DEFAULT_HEAD_DIMS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
_DEFAULT_KV_HEADS = {"starcoder2": 2, "stablelm": 32}  # else num_attention_heads
_DEFAULT_RMS_NORM_EPS = {"phi3": 1e-5, "mixtral": 1e-5, "olmo2": 1e-5, "olmoe": 1e-5}
_NORM_EPS_FIELDS = {"starcoder2": "norm_epsilon", "stablelm": "layer_norm_eps", "phi": "layer_norm_eps",
                    "gpt_neox": "layer_norm_eps", "gpt2": "layer_norm_epsilon"}
_MHA_ONLY = ("gpt_neox", "gpt2")  # no grouped-query attention: num_key_value_heads is ignored  # the LayerNorm families' name for it (default 1e-5)
_DEFAULT_ACTIVATIONS = {"gemma": "gelu_pytorch_tanh", "starcoder2": "gelu_pytorch_tanh", "phi": "gelu_new",
                        "gpt_neox": "gelu"}  # else silu
_TIED_BY_DEFAULT = (*GEMMA_TYPES, "starcoder2", "gpt2")
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
        return float(raw.get(_NORM_EPS_FIELDS[model_type], 1e-5))
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
    if model_type == "gpt2":
        return {"qkv_bias": True, "o_bias": True, "mlp_bias": True}
    attention_bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": _qkv_bias(raw, model_type, attention_bias),
            "o_bias": model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            "mlp_bias": bool(raw.get("mlp_bias", False))}


def _block_layout(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The LayerNorm families' norms and MLPs (ModelConfig's fields from layer_norm on)."""
    if model_type not in LAYER_NORM_TYPES:
        return {}
    if model_type == "stablelm":
        parallel = bool(raw.get("use_parallel_residual", False))
        return {"layer_norm": True, "qk_norm_per_head_weights": bool(raw.get("qk_layernorm")),
                "parallel_residual": parallel, "shared_block_norm": parallel, "parallel_adds_attention_first": True}
    if model_type == "phi":
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": True, "shared_block_norm": True}
    if model_type == "gpt_neox":  # parallel blocks by default, each half its own norm
        return {"layer_norm": True, "gated_mlp": False, "parallel_residual": bool(raw.get("use_parallel_residual", True))}
    return {"layer_norm": True, "gated_mlp": False, "learned_positions": model_type == "gpt2"}


def _gpt2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config.json under the names the other families use (as transformers' GPT2Config maps them);
    the settings this engine does not implement refused by name."""
    if raw.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("config.json: scale_attn_by_inverse_layer_idx: a score scale per layer is not supported")
    def read(name: str, llama_name: str, default: int) -> Any:
        return raw.get(name, raw.get(llama_name, default))

    hidden_size = read("n_embd", "hidden_size", 768)
    return {**raw, "hidden_size": hidden_size, "num_hidden_layers": read("n_layer", "num_hidden_layers", 12),
            "num_attention_heads": read("n_head", "num_attention_heads", 12),
            "max_position_embeddings": read("n_positions", "max_position_embeddings", 1024),
            "intermediate_size": raw.get("n_inner") or 4 * hidden_size,
            "hidden_act": raw.get("activation_function", "gelu_new")}


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
    if model_type == "gpt2" and not raw.get("scale_attn_weights", True):
        return {"attention_scale": 1.0}
    if model_type in ("gemma2", "gemma3_text"):
        softcaps = (50.0, 30.0) if model_type == "gemma2" else (None, None)  # transformers' defaults
        # Gemma 3 keeps attn_logit_softcapping in its config, but transformers never applies it.
        attention_softcap = raw.get("attn_logit_softcapping", softcaps[0]) if model_type == "gemma2" else None
        return {"norm_weight_offset": 1.0, "embedding_scale": math.sqrt(hidden_size),
                "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                "attention_softcap": attention_softcap,
                "logits_softcap": raw.get("final_logit_softcapping", softcaps[1]), "sandwich_norms": True}
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
