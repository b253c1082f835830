"""Tiny random Llamas: deterministic bytes, loadable and runnable by transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from services.instance.models import TINY_SHAPES, build_tiny_model
from services.instance.models.model_folder import REQUIRED_FILES

PROMPTS = ("What is the capital of France?", "Once upon a time", "def add(a, b):")


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_same_shape_and_seed_give_identical_files(tmp_path, shape):
    first = build_tiny_model(tmp_path / "a", shape)
    second = build_tiny_model(tmp_path / "b", shape, seed=0)
    assert sorted(p.name for p in first.iterdir()) == sorted(REQUIRED_FILES)
    assert _file_bytes(first) == _file_bytes(second)


def test_different_seed_changes_only_weights_and_source(tmp_path):
    a = _file_bytes(build_tiny_model(tmp_path / "a", "gqa-tied", seed=0))
    b = _file_bytes(build_tiny_model(tmp_path / "b", "gqa-tied", seed=1))
    assert [name for name in a if a[name] != b[name]] == ["config.json", "model.safetensors"]
    assert json.loads(b["config.json"])["ferry_source"] == "tiny:gqa-tied:seed=1"


def test_existing_model_is_reused_and_other_content_needs_force(tmp_path):
    out = build_tiny_model(tmp_path / "m", "mha-untied")
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(out, "mha-untied") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError, match="--force"):
        build_tiny_model(out, "gqa-tied")
    build_tiny_model(out, "gqa-tied", force=True)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folders left behind


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("services.instance.models.model_folder.save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path / "m", "gqa-tied")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_build_of_the_same_model_is_fine(tmp_path, monkeypatch):
    from services.instance.models import model_folder

    write_files, raced = model_folder._write_files, []

    def racing(folder, files):
        write_files(folder, files)
        if not raced:  # another process finishes the same model while this one writes
            raced.append(True)
            build_tiny_model(tmp_path / "m", "gqa-tied")

    monkeypatch.setattr(model_folder, "_write_files", racing)
    build_tiny_model(tmp_path / "m", "gqa-tied")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_unknown_shape_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="gqa-tied"):
        build_tiny_model(tmp_path / "m", "huge")


def test_config_matches_shape_and_tokenizer(tmp_path):
    out = build_tiny_model(tmp_path / "m", "gqa-tied")
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["vocab_size"] >= len(tokenizer)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (4, 2, 3)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 500000.0
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) in tokenizer.all_special_ids
    assert tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_transformers_loads_and_generates_varied_text(tmp_path, shape):
    out = build_tiny_model(tmp_path / "m", shape)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out)
    generations = set()
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        inputs = tokenizer(text, return_tensors="pt")
        num_prompt = inputs["input_ids"].shape[1]
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, num_prompt:].tolist()
        assert len(set(output)) > 3, output  # not stuck repeating one token
        generations.add(tuple(output))
    assert len(generations) == len(PROMPTS)


def test_tokenizer_round_trips_any_text(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", "mha-untied"))
    text = "Grüße, 世界! <|im_start|>x\n  tabs\tand emoji 🚢"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_cli_builds_and_documents_flags(tmp_path):
    run = [sys.executable, "-m", "services.instance.models"]
    out = tmp_path / "cli"
    args = ["build-tiny", "--out", str(out), "--shape", "gqa-tied", "--seed", "3"]
    done = subprocess.run([*run, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _file_bytes(out) == _file_bytes(build_tiny_model(tmp_path / "api", "gqa-tied", seed=3))
    helped = subprocess.run([*run, "build-tiny", "--help"], capture_output=True, text=True).stdout
    for flag in ("--out", "--shape", "--seed", "--force", "mha-untied"):
        assert flag in helped


def test_an_unwritable_out_is_a_usage_error_naming_it(tmp_path, capsys):
    from services.instance.models.__main__ import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "model"  # a folder inside a regular file cannot be made
    assert main(["build-tiny", "--out", str(out), "--shape", "gqa-tied"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: cannot write --out {out}: ") and "Errno" not in error
