"""GGUF Llama tensors -> Hugging Face `LlamaForCausalLM` weights.

llama.cpp's converter permutes the rows of `q_proj` and `k_proj` from Hugging Face's
rotate-half RoPE layout (each head's first half of dims pairs with its second half)
to GGML's interleaved layout (dims 2i and 2i+1 pair up). `reverse_rope_permute`
undoes that, exactly as transformers' GGUF loader does (`LlamaTensorProcessor`).
"""

import re

import gguf
import numpy as np
import torch

from services.instance.models.gguf_file import dequantized_tensors
from services.instance.models.llama_config import LlamaShape

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart; only plain Llama GGUFs are supported")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def reverse_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: per head, interleaved rows -> rotate-half rows."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def llama_weights(reader: gguf.GGUFReader, shape: LlamaShape) -> dict[str, torch.Tensor]:
    """All tensors, dequantized to float32, unpermuted, under Hugging Face names."""
    tensors = {}
    for name, array in dequantized_tensors(reader):
        if ".attn_q." in name:
            array = reverse_rope_permute(array, shape.num_attention_heads)
        elif ".attn_k." in name:
            array = reverse_rope_permute(array, shape.num_key_value_heads)
        tensors[hf_name(name)] = torch.from_numpy(np.ascontiguousarray(array))
    _check_complete(tensors, shape)
    return tensors


def _check_complete(tensors: dict[str, torch.Tensor], shape: LlamaShape) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(shape.num_hidden_layers):
        expected |= {f"model.layers.{i}.{part}.weight" for part in _LAYER_NAMES.values()}
    if not shape.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing, extra = expected - tensors.keys(), tensors.keys() - expected
    if missing or extra:
        raise ValueError(
            f"GGUF tensors do not match a {shape.num_hidden_layers}-layer Llama: "
            f"missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
    embed = tensors["model.embed_tokens.weight"].shape
    if tuple(embed) != (shape.vocab_size, shape.hidden_size):
        expected_embed = (shape.vocab_size, shape.hidden_size)
        raise ValueError(f"token_embd is {tuple(embed)}, expected (vocab_size, hidden_size) = {expected_embed}")
