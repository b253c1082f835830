"""Which layers attend through a sliding window, and the longest sequence a model is served
with, from its raw `config.json` (no torch: the frontend reads it too).

Sliding windows, as transformers applies them (a query at position p sees the keys at
positions p - W < j <= p):

* Mistral, Phi-3 and StarCoder2: `sliding_window` on every layer;
* Qwen2/Qwen3: with `use_sliding_window`, the layers `layer_types` marks "sliding_attention",
  or by default those from `max_window_layers` on; the window is 4096 unless config.json says otherwise;
* Gemma 2 (every other layer), Gemma 3 (five of every six) and Cohere 2 (three of every four):
  `layer_types`, or that default pattern; the window is 4096 unless config.json says otherwise;
* EXAONE 4 and OLMo 3 (three of every four) as Cohere 2; Ministral: `layer_types`, or every layer;
* SmolLM3: with `use_sliding_window` and a `sliding_window`, the layers `layer_types` marks, or by
  default its NoPE layers (`no_rope_layers`).

The served context is `max_position_embeddings`, or less for longrope RoPE (Phi-3/Phi-4
long-context models), which is exact only up to `original_max_position_embeddings` (rope.py).
"""

from dataclasses import dataclass
from typing import Any

# transformers' config classes' max_position_embeddings where config.json has none (GPT-2: n_positions)
DEFAULT_MAX_POSITIONS = 2048  # Llama's, Granite's, OLMo2's, Phi's, GPT-NeoX's
FAMILY_MAX_POSITIONS = {
    "gemma": 8192, "gemma2": 8192, "gemma3_text": 131072, "gpt2": 1024, "mistral": 131072, "mixtral": 131072,
    "olmoe": 4096, "phi3": 4096, "qwen2": 32768, "qwen2_moe": 32768, "qwen3": 32768, "qwen3_moe": 32768,
    "stablelm": 4096, "starcoder2": 4096, "smollm3": 32768, "cohere": 8192, "cohere2": 8192,
    "glm": 131072, "glm4": 131072, "helium": 4096, "ernie4_5": 131072, "seed_oss": 524288,
    "ministral": 131072, "arcee": 4096, "gpt_bigcode": 1024,
}
# transformers' defaults where config.json has none (Qwen2/Qwen3's apply only with use_sliding_window)
DEFAULT_WINDOWS = {"gemma2": 4096, "gemma3_text": 4096, "mistral": 4096, "qwen2": 4096, "qwen3": 4096, "cohere2": 4096,
                   "exaone4": 4096, "ministral": 4096, "olmo3": 4096}
SLIDING = "sliding_attention"
# How an instance's refusal of a prompt longer than its context says so (SamplingParams.validate): the frontend
# finds it in the message to give the client OpenAI's `context_length_exceeded` code (prompt_checks.py).
OVER_CONTEXT = "more than the model's context"


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens, None where it attends to the whole context."""
    model_type = raw.get("model_type")
    window = raw.get("sliding_window", DEFAULT_WINDOWS.get(model_type))
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return (None,) * num_layers
    return tuple(window if is_sliding else None for is_sliding in _sliding_layers(raw, model_type, num_layers))


def kv_window(windows: tuple[int | None, ...]) -> int | None:
    """How far back any layer reads: the widest window where every layer has one (the KV blocks behind
    it can be given back, block_manager.py), else None (some layer reads the whole context)."""
    if not windows or any(window is None for window in windows):
        return None
    return max(window for window in windows if window is not None)


def _sliding_layers(raw: dict[str, Any], model_type: str | None, num_layers: int) -> list[bool]:
    layer_types = raw.get("layer_types")
    if model_type in ("mistral", "mixtral", "phi3", "starcoder2"):
        return [True] * num_layers
    if model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return [False] * num_layers
        if layer_types:
            return [kind == SLIDING for kind in layer_types]
        first = int(raw.get("max_window_layers", 28))
        return [i >= first for i in range(num_layers)]
    if model_type == "smollm3":
        if not raw.get("use_sliding_window"):
            return [False] * num_layers
        if layer_types:
            return [kind == SLIDING for kind in layer_types]
        interval = max(int(raw.get("no_rope_layer_interval", 4)), 1)  # 0 is refused by rope.nope_layers
        uses_rope = raw.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(num_layers)]
        return [not flag for flag in uses_rope]
    if model_type == "ministral":
        return [kind == SLIDING for kind in layer_types] if layer_types else [True] * num_layers
    if model_type in ("gemma2", "gemma3_text", "cohere2", "exaone4", "olmo3"):
        if layer_types:
            return [kind == SLIDING for kind in layer_types]
        pattern = {"gemma2": 2, "gemma3_text": 6, "cohere2": 4, "exaone4": 4, "olmo3": 4}[model_type]
        pattern = raw.get("sliding_window_pattern", pattern) if model_type not in ("gemma2", "olmo3") else pattern
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise ValueError("config.json: sliding_window_pattern must be a positive integer where layer_types is "
                             f"not given, got {pattern!r}")
        return [bool((i + 1) % pattern) for i in range(num_layers)]
    return [False] * num_layers


def longrope_length(raw: dict[str, Any]) -> int | None:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    return original if isinstance(original, int) and original > 0 else None


@dataclass(frozen=True, slots=True)
class ContextLimit:
    length: int  # the longest sequence (prompt + output) the engine serves the model with, in tokens
    set_by: str  # the config.json setting it comes from


def max_positions(raw: dict[str, Any]) -> int:
    """`max_position_embeddings` (GPT-2's `n_positions`), or the family's default as transformers reads it."""
    default = FAMILY_MAX_POSITIONS.get(raw.get("model_type"), DEFAULT_MAX_POSITIONS)
    return int(raw.get("max_position_embeddings", raw.get("n_positions", default)))


def context_limit(raw: dict[str, Any]) -> ContextLimit:
    length = max_positions(raw)
    longrope = longrope_length(raw)
    if longrope is not None and longrope < length:
        return ContextLimit(longrope, "longrope's original_max_position_embeddings")
    return ContextLimit(length, "max_position_embeddings")


def checked_max_model_len(requested: int, limit: ContextLimit) -> int:
    """`--max-model-len` (0: the model's own limit), refused if longer than the model serves."""
    if requested > limit.length:
        raise ValueError(f"--max-model-len {requested} is longer than this model serves: {limit.length} tokens, "
                         f"its {limit.set_by}")
    return requested or limit.length
