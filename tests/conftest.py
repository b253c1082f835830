"""Fixtures shared by every test layer: tiny random-weight models built on the fly; the reaper plugin."""

from __future__ import annotations

import pathlib

import pytest

from services.instance.models.tiny import build_tiny_model
from tests.torch_threads import one_torch_thread  # noqa: F401 (autouse: every test module)

# Every process a test starts ends with this pytest, even a SIGKILLed one (tests/reaper.py).
pytest_plugins = ["tests.reaper_plugin"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny GQA Llama with tied embeddings and a real byte-level BPE tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gqa-tied", "gqa-tied", seed=0)


@pytest.fixture(scope="session")
def tiny_mha_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny MHA Llama with untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mha-untied", "mha-untied", seed=0)
