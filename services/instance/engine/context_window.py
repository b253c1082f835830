"""The longest sequence a model is served with, from its raw `config.json` (no torch: the
frontend reads it too).

That is `max_position_embeddings`, shortened where the model's own attention would differ from
the engine's full causal attention beyond some length:

* a sliding window of W tokens (Mistral's `sliding_window`; Qwen2/Qwen3 with
  `use_sliding_window` or a "sliding_attention" layer; Phi-3's `sliding_window`; Gemma 2's
  alternate layers, 4096 unless config.json says otherwise): a query
  sees the keys less than W positions back, so up to W tokens the window covers everything
  and full attention is exact;
* longrope RoPE (Phi-3/Phi-4 long-context models): exact up to
  `original_max_position_embeddings` (see rope.py).
"""

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_POSITIONS = 2048  # transformers' default where config.json has no max_position_embeddings


def sliding_window(raw: dict[str, Any]) -> int | None:
    """The sliding window the model's attention uses, in tokens, or None for full attention."""
    model_type = raw.get("model_type")
    window = raw.get("sliding_window", 4096 if model_type == "gemma2" else None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if model_type in ("qwen2", "qwen3"):
        uses_window = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ())
        return window if uses_window else None
    return window if model_type in ("mistral", "phi3", "gemma2") else None


def longrope_length(raw: dict[str, Any]) -> int | None:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    return original if isinstance(original, int) and original > 0 else None


@dataclass(frozen=True, slots=True)
class ContextLimit:
    length: int  # the longest sequence (prompt + output) the engine serves the model with, in tokens
    set_by: str  # the config.json setting it comes from


def context_limit(raw: dict[str, Any]) -> ContextLimit:
    limits = [(int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)), "max_position_embeddings"),
              (sliding_window(raw), "sliding_window"),
              (longrope_length(raw), "longrope's original_max_position_embeddings")]
    length, set_by = min((limit for limit in limits if limit[0] is not None), key=lambda limit: limit[0])
    return ContextLimit(length, set_by)


def checked_max_model_len(requested: int, limit: ContextLimit) -> int:
    """`--max-model-len` (0: the model's own limit), refused if longer than the model serves."""
    if requested > limit.length:
        raise ValueError(f"--max-model-len {requested} is longer than this model serves: {limit.length} tokens, "
                         f"its {limit.set_by}")
    return requested or limit.length
