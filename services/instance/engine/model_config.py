"""The model's shape, read from a Hugging Face `config.json`.

The Llama family is supported: `model_type` "llama"; "mistral" without a sliding
window; "qwen2" (biases on q/k/v, none on o) and "qwen3" (an RMSNorm over each query and
key head before RoPE), both without sliding windows. Both the old (`rope_theta` +
`rope_scaling`) and the new (`rope_parameters`, transformers >= 5) spellings of the RoPE
settings are read.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # "linear" or "llama3"
    factor: float  # positions are stretched by this much
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


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
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool  # the LM head reuses the embedding matrix
    qkv_bias: bool  # q/k/v projections carry a bias
    o_bias: bool  # the output projection carries a bias
    qk_norm: bool  # an RMSNorm (head_dim wide) over each query and key head before RoPE
    mlp_bias: bool  # gate/up/down projections carry a bias
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos_token_id, int or list, as a tuple
    torch_dtype: str  # the dtype the checkpoint was saved in, e.g. "bfloat16"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}: pass --model a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = _model_type(raw)
        num_heads = _required_int(raw, "num_attention_heads")
        hidden_size = _required_int(raw, "hidden_size")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        rope_theta, rope_scaling = _rope(raw)
        config = cls(
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=_required_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            vocab_size=_required_int(raw, "vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=_dtype_name(raw),
        )
        _check_activation(raw)
        return config


def _model_type(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; "
            f"the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "mistral" and raw.get("sliding_window") is not None:
        raise ValueError(
            f"config.json: sliding_window={raw['sliding_window']} is not supported; "
            "only Mistral models without a sliding window run on the torch engine"
        )
    if model_type in ("qwen2", "qwen3") and (raw.get("use_sliding_window")
                                             or "sliding_attention" in (raw.get("layer_types") or ())):
        raise ValueError(
            f"config.json: use_sliding_window=true is not supported; only {model_type} models with full "
            "attention in every layer run on the torch engine"
        )
    return model_type


def _required_int(raw: dict[str, Any], field: str) -> int:
    value = raw.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json: {field} must be a positive integer, got {value!r}")
    return value


def _check_activation(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; only 'silu' (SwiGLU) is")


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


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the old or the transformers-5 layout."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; "
            f"use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"config.json: rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The RoPE inverse frequencies [head_dim // 2], float32, as transformers computes them."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
