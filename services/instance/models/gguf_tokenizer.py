"""A `tokenizers` byte-level BPE rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is supported. The pre-tokenizer
follows `tokenizer.ggml.pre`: llama.cpp's "smollm" (also "starcoder", "refact",
"command-r", "codeshell", "exaone") first isolates every digit (`\\p{N}`), then splits
with the GPT-2 regex -- the same as SmolLM2's own `tokenizer.json` (`Digits` then
`ByteLevel`). Note that transformers' GGUF loader does not know "smollm" and falls back
to the plain GPT-2 split, which differs on text such as "in  2024".
"""

from enum import IntEnum
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from services.instance.models.gguf_file import require

_DIGIT_FIRST_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo", "jais"}


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    model = require(metadata, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    tokens = require(metadata, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in require(metadata, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_special_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_FIRST_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(_DIGIT_FIRST_PRE | _GPT2_PRE)}")


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole)."""
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == TokenType.CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == TokenType.USER_DEFINED]
    )
