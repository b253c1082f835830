"""Shared by the family tests: a tiny transformers model with random norms and biases saved where ferry
can load it (with the tiny tokenizer), transformers' greedy tokens, and the check that ferry's equal them
alone and in a busy batch."""

from __future__ import annotations

import pathlib

import torch

from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.model import allocate_kv_cache, load_model
from services.instance.engine.request import SamplingParams
from services.instance.models import build_tiny_model

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2, 250, 31], [64, 65, 66, 67, 68, 69, 70, 71, 72], [9],
           [(7 * i) % 500 + 3 for i in range(40)]]  # the last one prefilled in chunks


def save_random_family_model(model_dir: pathlib.Path, hf_config) -> tuple[pathlib.Path, object]:
    """`hf_config`'s model with norm weights around 1 and biases around 0 (both random), saved in
    `model_dir` beside the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(model_dir, "gqa-tied")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model_dir / name).unlink()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    hf_model.save_pretrained(model_dir)
    return model_dir, hf_model


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, end-of-sequence included where it is the argmax, as `ignore_eos` takes it
    (min_new_tokens would mask it instead: a black-box run found a prompt where that differs)."""
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def assert_greedy_equals_transformers(model_dir: pathlib.Path, hf_model, kv_name: str) -> None:
    """ferry's greedy tokens for PROMPTS, each alone and all in one batch, equal transformers'."""
    loaded = build_engine(EngineSpec(model_dir, kv_name=kv_name, kv_cache_mib=8, max_num_seqs=8,
                                     max_num_batched_tokens=24))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        expected = [hf_greedy(hf_model, prompt, 20) for prompt in PROMPTS]
        assert [loaded.engine.generate([prompt], greedy)[0] for prompt in PROMPTS] == expected
        assert loaded.engine.generate(PROMPTS, greedy) == expected
        if loaded.engine.block_manager.window is not None:  # a window on every layer: blocks behind it went back
            assert loaded.engine.block_manager.num_blocks_dropped >= 4
    finally:
        loaded.close()


def prefill_logits(model, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """The last token's logits of one prompt prefilled whole."""
    num_blocks = -(-len(prompt) // block_size)
    cache = allocate_kv_cache(model.config, num_blocks, block_size, dtype=model.dtype)
    batch = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(len(prompt)),
                         slot_mapping=torch.arange(len(prompt)), query_lens=[len(prompt)],
                         context_lens=torch.tensor([len(prompt)]), block_tables=torch.arange(num_blocks)[None])
    return model(batch, cache)[0]


def assert_float32_logits_equal_transformers(model_dir: pathlib.Path, hf_model) -> None:
    """The last token's float32 logits of a prompt prefilled whole, within 1e-5 of transformers'."""
    prompt = PROMPTS[4]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(load_model(model_dir), prompt), expected, rtol=1e-5, atol=1e-5)
