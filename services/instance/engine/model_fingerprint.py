"""A model folder's fingerprint: a short stable hash that tells two sets of weights apart, read cheaply.

Two fine-tunes of one base share config.json, the KV layout and the vocabulary, so nothing else in an
instance's record tells them apart; a request moved from one to the other would go on with the other's
weights (silently wrong answers). The fingerprint hashes, for every tensor of the checkpoint (sorted by
name, so sharding does not change it): its name, dtype and shape, and WINDOW_BYTES of its data at its
start, middle and end. A fine-tune changes nearly every value of the tensors it trains (a merged LoRA:
every value of each adapted matrix), so those windows differ; reading them costs three small reads a
tensor (about 200 KiB for SmolLM2's 273 tensors, a few milliseconds), never the whole file. Safetensors
metadata (`__metadata__`, which tools fill in at will) and the files' names are left out.

`pytorch_model*.bin` files (a zip of pickled storages, read here without torch) are hashed by size and
BIN_WINDOWS windows spread over each file. A GGUF model is served from the folder `services.instance.models`
converts it into (safetensors), so it is fingerprinted as that folder. The sim engine reads no weights but
runs as the model its folder holds: it gets that folder's fingerprint, as the torch engine does.

A folder with no weight files (a frontend's copy holding config and tokenizer only) has none: "", which
compares equal to anything (as a record from before the field). No torch here: the frontend imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path

import structlog

WINDOW_BYTES = 256  # read at a tensor's start, middle and end
BIN_WINDOWS = 64  # windows spread over a pytorch_model*.bin file
_HEADER_LEN = struct.Struct("<Q")  # safetensors: the JSON header's length, then the header
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def fingerprint_if_readable(model_dir: str | Path) -> str:
    """model_fingerprint, or "" (compares equal to anything) with a warning where a weight file cannot be read:
    for the sim engine and the frontend, which load no weights (a Git LFS pointer or a truncated file must not
    stop them, as it did not before the fingerprint)."""
    try:
        return model_fingerprint(model_dir)
    except (OSError, ValueError) as exc:
        structlog.get_logger(__name__).warning("model_fingerprint_unreadable", model_dir=str(model_dir),
                                               error=str(exc), hint="not told apart from other weights")
        return ""


def model_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits naming the weights in `model_dir`; "" if it holds no weight files. ValueError names a
    file that is not what its name says."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=8)
    if files := _safetensors_files(model_dir):
        _hash_safetensors(digest, files)
    elif files := _bin_files(model_dir):
        for path in files:
            _hash_raw(digest, path)
    else:
        return ""
    return digest.hexdigest()


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The files the torch engine loads (weights.py): those an index names, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / name for name in _weight_map(index).values()})
    return sorted(model_dir.glob("*.safetensors"))


def _bin_files(model_dir: Path) -> list[Path]:
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        return sorted({model_dir / name for name in _weight_map(index).values()})
    return sorted(model_dir.glob("pytorch_model*.bin"))


def _weight_map(index: Path) -> dict[str, str]:
    try:
        return json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a checkpoint index with a weight_map ({exc})") from None


def _hash_safetensors(digest: hashlib.blake2b, files: list[Path]) -> None:
    tensors = {}  # name → (file, dtype, shape, first byte, end byte)
    for path in files:
        tensors.update(_tensors_of(path))
    with contextlib.ExitStack() as stack:
        fds = {path: stack.enter_context(path.open("rb")).fileno() for path in files}
        for name in sorted(tensors):
            path, dtype, shape, begin, end = tensors[name]
            digest.update(json.dumps([name, dtype, shape, end - begin]).encode())
            for offset in _window_offsets(begin, end):
                digest.update(os.pread(fds[path], min(WINDOW_BYTES, end - offset), offset))


def _tensors_of(path: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """Each tensor of a safetensors file, with its data's byte range in the file."""
    try:
        with path.open("rb") as file:
            (header_len,) = _HEADER_LEN.unpack(file.read(_HEADER_LEN.size))
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"header of {header_len} bytes")
            header = json.loads(file.read(header_len))
        data_start = _HEADER_LEN.size + header_len
        return {name: (path, str(info["dtype"]), list(info["shape"]), data_start + int(info["data_offsets"][0]),
                       data_start + int(info["data_offsets"][1]))
                for name, info in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None


def _window_offsets(begin: int, end: int) -> list[int]:
    """Where the windows of a tensor's data start: at its start, middle and end (fewer if it is short)."""
    last = max(begin, end - WINDOW_BYTES)
    return sorted({begin, begin + (last - begin) // 2, last})


def _hash_raw(digest: hashlib.blake2b, path: Path) -> None:
    size = path.stat().st_size
    digest.update(json.dumps([path.suffix, size]).encode())
    last = max(0, size - WINDOW_BYTES)
    with path.open("rb") as file:
        for i in range(BIN_WINDOWS):
            digest.update(os.pread(file.fileno(), WINDOW_BYTES, last * i // (BIN_WINDOWS - 1)))
