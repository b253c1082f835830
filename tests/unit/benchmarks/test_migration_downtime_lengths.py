"""migration_downtime serves each model within its context, and says which lengths do not fit."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def downtime(monkeypatch):
    return load_benchmark(ROOT / "benchmarks/migration_downtime.py", monkeypatch)


def model_with_context(tmp_path: pathlib.Path, positions: int) -> pathlib.Path:
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=positions)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_serving_length_leaves_room_to_decode_within_the_models_context(downtime, tmp_path):
    short = model_with_context(tmp_path, 8192)
    assert downtime.serving_length([256, 1024], short) == 1024 + downtime.MAX_OUTPUT_TOKENS + 64
    assert downtime.serving_length([256, 8064], short) == 8192  # capped: 128 tokens left to decode
    with pytest.raises(SystemExit, match="the longest length may be 8064"):
        downtime.serving_length([256, 8128], short)
