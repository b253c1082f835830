"""The model fingerprint: other weights (two fine-tunes of one base, same config) give another one; the same
weights the same one, however they are sharded; read from a few windows per tensor, not the whole file."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from services.instance.engine import model_fingerprint as fingerprint_module
from services.instance.engine.model_fingerprint import WINDOW_BYTES, fingerprint_if_readable, model_fingerprint
from services.instance.models import build_tiny_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny model of seed 0 (twice, in two folders) and of seed 1: one config, other weights."""
    root = tmp_path_factory.mktemp("fingerprint")
    return (build_tiny_model(root / "a", "gqa-tied", seed=0), build_tiny_model(root / "a-again", "gqa-tied", seed=0),
            build_tiny_model(root / "b", "gqa-tied", seed=1))


def test_other_weights_of_one_config_get_another_fingerprint(seeds):
    a, a_again, b = seeds
    assert json.loads((a / "config.json").read_text())["vocab_size"] == json.loads((b / "config.json").read_text())[
        "vocab_size"]
    assert len(model_fingerprint(a)) == 16
    assert model_fingerprint(a) == model_fingerprint(a_again) != model_fingerprint(b)


def test_a_fine_tune_of_one_matrix_is_told_apart(seeds, tmp_path):
    """A merged LoRA on one projection changes every value of that matrix and nothing else."""
    tuned = shutil.copytree(seeds[0], tmp_path / "tuned")
    tensors = load_file(tuned / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    low_rank = torch.randn(tensors[name].shape[0], 2, generator=torch.Generator().manual_seed(7)) @ torch.randn(
        2, tensors[name].shape[1], generator=torch.Generator().manual_seed(8))
    save_file({**tensors, name: tensors[name] + 1e-3 * low_rank}, tuned / "model.safetensors")
    assert model_fingerprint(tuned) != model_fingerprint(seeds[0])


def test_sharding_and_metadata_do_not_change_it(seeds, tmp_path):
    sharded = shutil.copytree(seeds[0], tmp_path / "sharded", ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(seeds[0] / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt", "tool": file})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert model_fingerprint(sharded) == model_fingerprint(seeds[0])


def test_pytorch_bin_checkpoints_are_fingerprinted_too(seeds, tmp_path):
    folders = []
    for i, source in enumerate((seeds[0], seeds[0], seeds[2])):
        folder = shutil.copytree(source, tmp_path / f"bin-{i}", ignore=shutil.ignore_patterns("*.safetensors"))
        torch.save(load_file(source / "model.safetensors"), folder / "pytorch_model.bin")
        folders.append(folder)
    assert model_fingerprint(folders[0]) == model_fingerprint(folders[1]) != model_fingerprint(folders[2])
    assert model_fingerprint(folders[0]) not in ("", model_fingerprint(seeds[0]))


def test_a_folder_without_weights_has_none(seeds, tmp_path):
    """A frontend's copy of config and tokenizer alone: "" (not checked against anything)."""
    bare = shutil.copytree(seeds[0], tmp_path / "bare", ignore=shutil.ignore_patterns("*.safetensors"))
    assert model_fingerprint(bare) == ""


def test_a_broken_weights_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        model_fingerprint(tmp_path)


def test_the_sim_engine_and_the_frontend_go_on_without_one_where_a_weights_file_is_unreadable(tmp_path):
    """They load no weights, and a Git LFS pointer in place of the weights did not stop them before the
    fingerprint: "" (compares equal to anything), with a warning."""
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
    with capture_logs() as logs:
        assert fingerprint_if_readable(tmp_path) == ""
    assert [entry["event"] for entry in logs] == ["model_fingerprint_unreadable"]


def test_it_reads_three_windows_per_tensor_not_the_weights(tmp_path, monkeypatch):
    """Loading stays fast: a 16 MiB tensor costs three reads of WINDOW_BYTES, as a small one does."""
    save_file({"big.weight": torch.zeros(2048, 2048), "small.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    reads: list[int] = []
    pread = os.pread

    def counted_pread(fd: int, size: int, offset: int) -> bytes:
        reads.append(size)
        return pread(fd, size, offset)
    monkeypatch.setattr(fingerprint_module.os, "pread", counted_pread)
    model_fingerprint(tmp_path)
    assert sorted(reads) == [16, WINDOW_BYTES, WINDOW_BYTES, WINDOW_BYTES]  # the 16-byte tensor: one window
