"""Writing a Hugging Face model folder atomically, and recognising a finished one.

A folder is built in a hidden temporary sibling and renamed into place, so an
interrupted build never leaves a half-written folder under the requested name.
`config.json` records where the weights came from (`ferry_source`; not in the
safetensors metadata, whose key order is random and would break byte-identical
rebuilds); a folder whose files are all present, whose weights file opens and
whose source matches is reused instead of rebuilt.
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"
SOURCE_KEY = "ferry_source"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Everything that goes into a model folder."""

    source: str  # provenance, e.g. "tiny:gqa-tied:seed=0"; stored as config.json's "ferry_source"
    config: dict  # config.json
    generation_config: dict  # generation_config.json
    tokenizer_json: str  # tokenizer.json, as serialised by `tokenizers`
    tokenizer_config: dict  # tokenizer_config.json
    tensors: dict[str, torch.Tensor]  # Hugging Face weight names -> float32 tensors


def source_of(folder: Path) -> str | None:
    """The `ferry_source` of a complete folder, or None if it is incomplete or unreadable."""
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return None
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt"):
            pass
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get(SOURCE_KEY)
    except (OSError, ValueError, safetensors.SafetensorError):
        return None


def is_complete(folder: Path, source: str) -> bool:
    return source_of(folder) == source


def write_model_folder(out_dir: Path, files: ModelFiles, *, force: bool) -> Path:
    """Write `files` to `out_dir` atomically; replace an existing folder only with `force`."""
    out_dir = Path(out_dir)
    _check_replaceable(out_dir, files.source, force=force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_files(tmp, files)
        _move_into_place(tmp, out_dir, files.source, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _check_replaceable(out_dir: Path, source: str, *, force: bool) -> None:
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists and is not a model built from {source!r}; pass --force to replace it")


def _write_files(folder: Path, files: ModelFiles) -> None:
    _write_json(folder / "config.json", {**files.config, SOURCE_KEY: files.source})
    _write_json(folder / "generation_config.json", files.generation_config)
    _write_json(folder / "tokenizer_config.json", files.tokenizer_config)
    (folder / "tokenizer.json").write_text(files.tokenizer_json, encoding="utf-8")
    tensors = {name: t.contiguous() for name, t in files.tensors.items()}
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    os.chmod(folder, 0o755)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(tmp: Path, out_dir: Path, source: str, *, force: bool) -> None:
    """Rename `tmp` to `out_dir`; a concurrent build of the same model finishing first is fine."""
    if is_complete(out_dir, source) and not force:
        return
    _check_replaceable(out_dir, source, force=force)  # again: out_dir may have appeared meanwhile
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.rename(out_dir, old / "folder")
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not is_complete(out_dir, source):
            raise
