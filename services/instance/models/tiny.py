"""Tiny random-weight Llama models for tests: same shape and seed, same bytes.

Weights are drawn with a seeded `torch.Generator` in a fixed order. Embeddings are
drawn with std 0.3 and the other matrices with std 0.2 so greedy outputs differ across
prompts and do not collapse into repeating one token (at std 0.1 the tied shape does).
"""

from pathlib import Path

import torch

from services.instance.models.llama_config import LlamaShape, SpecialTokenIds, config_json, generation_config_json
from services.instance.models.model_folder import ModelFiles, is_complete, write_model_folder
from services.instance.models.tiny_tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    TINY_VOCAB_SIZE,
    train_tiny_tokenizer,
)
from services.instance.models.tokenizer_config import tokenizer_config_json

_COMMON = dict(vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=1024, rms_norm_eps=1e-5)
TINY_SHAPES: dict[str, LlamaShape] = {
    "mha-untied": LlamaShape(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        rope_theta=10000.0, tie_word_embeddings=False, **_COMMON,
    ),
    "gqa-tied": LlamaShape(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=500000.0, tie_word_embeddings=True, **_COMMON,
    ),
    "mqa-untied": LlamaShape(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        rope_theta=10000.0, tie_word_embeddings=False, **_COMMON,
    ),
    # Long context and a KV cache big enough that copying all of it shows (4 KiB a token in
    # float32): the migration downtime benchmark runs sequences of up to 8192 tokens.
    "long-context": LlamaShape(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        rope_theta=500000.0, tie_word_embeddings=True, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=16384,
        rms_norm_eps=1e-5,
    ),
}  # fmt: skip
TINY_IDS = SpecialTokenIds(bos_token_id=0, eos_token_id=0, pad_token_id=0)  # all <|endoftext|>
EMBEDDING_STD = 0.3
MATRIX_STD = 0.2
NORM_STD = 0.1


def build_tiny_model(out_dir: Path | str, shape: str, seed: int = 0, *, force: bool = False) -> Path:
    """Write a tiny random Llama named `shape` (a key of `TINY_SHAPES`) to `out_dir`.

    Reuses `out_dir` if it already holds this exact model; replaces anything else only
    with `force`.
    """
    if shape not in TINY_SHAPES:
        raise ValueError(f"unknown tiny shape {shape!r}; choose --shape from {', '.join(TINY_SHAPES)}")
    out_dir = Path(out_dir)
    source = f"tiny:{shape}:seed={seed}"
    if is_complete(out_dir, source):
        return out_dir
    return write_model_folder(out_dir, _tiny_files(TINY_SHAPES[shape], seed, source), force=force)


def _tiny_files(shape: LlamaShape, seed: int, source: str) -> ModelFiles:
    tokenizer = train_tiny_tokenizer()
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but vocab_size is {shape.vocab_size}")
    tokenizer_config = tokenizer_config_json(
        tokenizer, bos=ENDOFTEXT, eos=ENDOFTEXT, pad=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE, model_max_length=shape.max_position_embeddings,
    )  # fmt: skip
    return ModelFiles(
        source=source,
        config=config_json(shape, TINY_IDS),
        generation_config=generation_config_json(TINY_IDS),
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tokenizer_config,
        tensors=random_llama_weights(shape, seed),
    )


def random_llama_weights(shape: LlamaShape, seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights under Hugging Face Llama names, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*size: int, std: float = MATRIX_STD) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(shape.hidden_size, std=NORM_STD)

    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    tensors = {"model.embed_tokens.weight": normal(shape.vocab_size, h, std=EMBEDDING_STD)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm_weight()
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, h)
        tensors[p + "post_attention_layernorm.weight"] = norm_weight()
        tensors[p + "mlp.gate_proj.weight"] = normal(shape.intermediate_size, h)
        tensors[p + "mlp.up_proj.weight"] = normal(shape.intermediate_size, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, shape.intermediate_size)
    tensors["model.norm.weight"] = norm_weight()
    if not shape.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(shape.vocab_size, h, std=EMBEDDING_STD)
    return tensors
