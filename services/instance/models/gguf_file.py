"""Reading a GGUF file: its metadata as plain Python values, its tensors dequantized."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm


def open_gguf(path: Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; pass --gguf PATH to an existing .gguf file")
    try:
        return gguf.GGUFReader(path)
    except ValueError as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field, e.g. `llama.block_count` -> 30, `tokenizer.ggml.tokens` -> [str, ...]."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata has no {key!r}; is this a Llama-family GGUF?")
    return metadata[key]


def dequantized_tensors(reader: gguf.GGUFReader, *, desc: str = "dequantizing") -> Iterator[tuple[str, np.ndarray]]:
    """`(gguf name, float32 array)` per tensor, shaped row-major like PyTorch (`[out, in]`).

    GGUF lists dimensions innermost first (`token_embd` is `[hidden, vocab]`); the reader's
    arrays, and so these, are already in the reverse, row-major order.
    """
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor"):
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # F32 tensors come back as read-only views of the file; torch wants writable memory
        array = np.require(array, dtype=np.float32, requirements=["C", "W"])
        yield tensor.name, array.reshape(tuple(reversed(tensor.shape.tolist())))
