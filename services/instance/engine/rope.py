"""RoPE settings read from a Hugging Face `config.json`, and the inverse frequencies they give.

Both spellings are read: the old one (`rope_theta` + `rope_scaling`) and the one of
transformers >= 5 (`rope_parameters`). Supported types, each computed as transformers does:

* `default`, and `dynamic` (dynamic NTK leaves the frequencies alone up to
  `max_position_embeddings`, the longest sequence the engine serves);
* `linear` (positions stretched by `factor`), `llama3` (Llama 3.1's smoothed bands) and
  `yarn` (Qwen2.5/Qwen3 long context, DeepSeek: interpolated and extrapolated bands, and an
  attention factor on cos and sin);
* `longrope` (Phi-3/Phi-4): the short factors and the attention factor. transformers switches to
  the long factors once a sequence passes `original_max_position_embeddings`, which a paged
  cache cannot follow (the keys already cached were rotated with the short ones), so the
  engine serves such models up to that length (`RopeConfig.max_length`).

`partial_rotary_factor` < 1 rotates only the first part of each head (`rotary_dim`).

SmolLM3, Cohere 2 and EXAONE 4 leave RoPE out on some layers (NoPE: `nope_layers`); GPT-J's is
always of base 10000 over `rotary_dim` dims; Hunyuan's `dynamic` RoPE with an `alpha` is a
larger base.

Gemma 3 and OLMo 3 rotate their sliding-window layers with a RoPE of their own (`read_layer_ropes`; OLMo 3's
has its base and no scaling):
`rope_parameters` keyed by layer type, or the old `rope_theta` (global, scaled by
`rope_scaling`) and `rope_local_base_freq`.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

# model types whose RoPE rotates only partial_rotary_factor of each head, and transformers' factor where config.json
# has none (GPT-J's rotary_dim: read_layer_ropes)
PARTIAL_ROTARY_TYPES = ("phi3", "stablelm", "phi", "gpt_neox", "glm", "glm4")
_DEFAULT_PARTIAL_ROTARY = {"stablelm": 0.25, "phi": 0.5, "gpt_neox": 0.25, "glm": 0.5, "glm4": 0.5}
SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading dims of each head that are rotated (even)
    rope_type: str = "default"  # "default", "linear", "llama3", "yarn" or "longrope" ("dynamic" reads as "default")
    factor: float = 1.0  # linear, llama3 and yarn: positions are stretched by this much
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, yarn and longrope
    beta_fast: float = 32.0  # yarn only: rotations where extrapolation ends ...
    beta_slow: float = 1.0  # ... and interpolation begins
    truncate: bool = True  # yarn only: round the ramp's ends to whole dims
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors
    attention_factor: float = 1.0  # yarn and longrope: cos and sin are scaled by it

    @property
    def max_length(self) -> int | None:
        """The longest sequence these settings are exact for, if they limit it (longrope)."""
        return self.original_max_position_embeddings if self.rope_type == "longrope" else None


FULL, SLIDING = "full_attention", "sliding_attention"


def read_layer_ropes(raw: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(the RoPE of full-attention layers, that of sliding-window layers if it differs)."""
    if raw.get("model_type") == "gptj":  # a plain RoPE of base 10000 over the first rotary_dim dims, whatever else
        rotary_dim = raw.get("rotary_dim", 64) or head_dim  # GPTJConfig's default; null: the whole head
        return RopeConfig(10000.0, _rotary_dim(rotary_dim / head_dim, head_dim)), None
    if raw.get("model_type") not in ("gemma3_text", "olmo3"):
        return read_rope(raw, head_dim), None
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, sliding = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full, sliding = dict(raw.get("rope_scaling") or {}), {}
    if raw["model_type"] == "olmo3":  # one base for both, the scaling on the full-attention layers only
        full.setdefault("rope_theta", raw.get("rope_theta", 500_000.0))
        sliding.setdefault("rope_theta", raw.get("rope_theta", 500_000.0))
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))  # transformers' defaults per layer type
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return read_rope(raw, head_dim, full), read_rope(raw, head_dim, sliding)


_DEFAULT_THETAS = {"mixtral": 1_000_000.0, "smollm3": 2_000_000.0, "cohere": 500_000.0, "helium": 100_000.0,
                   "ernie4_5": 500_000.0}  # transformers' rope_theta where a config.json leaves it out (else 10000)


def nope_layers(raw: dict[str, Any], windows: tuple[int | None, ...]) -> tuple[bool, ...]:
    """Per layer, True where it applies no RoPE at all (NoPE); () where every layer does. SmolLM3: where
    `no_rope_layers` says 0 (by default every `no_rope_layer_interval`-th layer); Cohere 2: its global layers,
    those without a sliding window (`windows`, context_window.layer_windows), and EXAONE 4's where it has a
    sliding_window at all."""
    model_type, num_layers = raw.get("model_type"), len(windows)
    if model_type == "cohere2" or model_type == "exaone4" and raw.get("sliding_window", 4096) is not None:
        return tuple(window is None for window in windows)
    if model_type != "smollm3":
        return ()
    uses_rope = raw.get("no_rope_layers")
    if uses_rope is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        if interval <= 0:
            raise ValueError(f"config.json: no_rope_layer_interval must be a positive integer, got {interval}")
        uses_rope = [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(uses_rope, list) or len(uses_rope) != num_layers:
        raise ValueError(f"config.json: no_rope_layers must list one 0 or 1 per layer ({num_layers}), "
                         f"got {uses_rope!r}")
    return tuple(not flag for flag in uses_rope)


def read_rope(raw: dict[str, Any], head_dim: int, params: dict[str, Any] | None = None) -> RopeConfig:
    """The RoPE settings of a config.json (either layout; `params`: those of one layer type);
    ValueError naming what is unsupported."""
    if params is None:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    default_theta = raw.get("rotary_emb_base", _DEFAULT_THETAS.get(raw.get("model_type"), 10000.0))  # NeoX's name
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if raw.get("model_type") == "hunyuan_v1_dense" and rope_type == "dynamic" and params.get("alpha"):
        theta *= float(params["alpha"]) ** (head_dim / (head_dim - 2))  # Hunyuan's NTK alpha: a larger base
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; "
            f"use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rotary_dim = _rotary_dim(_partial_rotary_factor(raw, params, rope_type), head_dim)
    if rope_type in ("default", "dynamic"):
        return RopeConfig(theta, rotary_dim)
    if rope_type == "longrope":
        return _longrope(raw, params, theta, rotary_dim)
    if "factor" not in params:
        raise ValueError(f"config.json: rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta, rotary_dim, "linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        return _yarn(raw, params, theta, rotary_dim)
    return RopeConfig(
        theta, rotary_dim, "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=_original_max_positions(raw, params),
    )


def _original_max_positions(raw: dict[str, Any], params: dict[str, Any]) -> int:
    """The pretraining length, where transformers looks for it: config.json's top level first
    (Phi-3 keeps it there), then the RoPE settings, else max_position_embeddings."""
    value = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    return int(value or raw.get("max_position_embeddings", 2048))


def _yarn(raw: dict[str, Any], params: dict[str, Any], theta: float, rotary_dim: int) -> RopeConfig:
    original = _original_max_positions(raw, params)
    factor = float(params["factor"] or int(raw.get("max_position_embeddings", original)) / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = _yarn_mscale(factor, 1.0)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return RopeConfig(theta, rotary_dim, "yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _partial_rotary_factor(raw: dict[str, Any], params: dict[str, Any], rope_type: str) -> float:
    """Phi-3 and the PARTIAL_ROTARY_TYPES rotate part of each head; transformers' other families here rotate all of it whatever
    the config says (with a scaled RoPE they cannot run such a config at all)."""
    default = _DEFAULT_PARTIAL_ROTARY.get(raw.get("model_type"), 1.0)
    default = raw.get("rotary_pct", default)  # GPT-NeoX's name for it
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default)))
    if raw.get("model_type") in PARTIAL_ROTARY_TYPES or factor == 1.0:
        return factor
    if rope_type in ("default", "dynamic"):
        return 1.0
    raise ValueError(f"config.json: partial_rotary_factor={factor} with rope type {rope_type!r}: only "
                     f"{', '.join(PARTIAL_ROTARY_TYPES)} rotate part of each head (transformers cannot run this "
                     "config either); remove partial_rotary_factor")


def _rotary_dim(partial_rotary_factor: float, head_dim: int) -> int:
    rotary_dim = int(head_dim * partial_rotary_factor)
    if not 0 < partial_rotary_factor <= 1 or rotary_dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor={partial_rotary_factor} must be in (0, 1] and "
                         f"rotate an even number of the {head_dim} head dims")
    return rotary_dim


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float, rotary_dim: int) -> RopeConfig:
    original = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    short_factor = params.get("short_factor")
    if not isinstance(original, int) or not isinstance(short_factor, list) or len(short_factor) != rotary_dim // 2:
        raise ValueError("config.json: longrope needs original_max_position_embeddings and a short_factor of "
                         f"{rotary_dim // 2} numbers")
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta, rotary_dim, "longrope", original_max_position_embeddings=original,
                      short_factor=tuple(float(f) for f in short_factor), attention_factor=float(attention_factor))


def rope_inv_freq(rope: RopeConfig) -> torch.Tensor:
    """The RoPE inverse frequencies [rotary_dim // 2], float32, as transformers computes them."""
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rope.rotary_dim
    if rope.rope_type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope.theta**exponents, rope)
    return inv_freq


def _yarn_inv_freq(pos_freqs: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Interpolated (divided by factor) below the slow band, extrapolated (kept) above the fast one, a ramp between."""
    def correction_dim(num_rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return rope.rotary_dim * math.log(length / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope.rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rope.rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (rope.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
