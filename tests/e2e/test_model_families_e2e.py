"""Another model family through the whole cluster: a random Qwen3 checkpoint (per-head q/k
RMSNorm, head_dim 32 with hidden_size 64) written by transformers, served by the launcher,
answered greedily and migrated mid-stream; every token must equal transformers' `generate`."""

from __future__ import annotations

import pathlib

import pytest
import torch

from services.common.gen.ferry.v1 import manager_pb2
from services.instance.engine.tokenizer import Tokenizer
from services.instance.models import build_tiny_model
from services.instance.models.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.e2e.conftest import launched_cluster, model_name

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[pathlib.Path, object]:
    """The tiny models' tokenizer with random Qwen3 weights (and the transformers model)."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "gqa-tied")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model_dir / name).unlink()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    hf_model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1)
    hf_model.save_pretrained(model_dir)
    return model_dir, hf_model


@pytest.fixture(scope="module")
def cluster(qwen3, tmp_path_factory):
    with launched_cluster(qwen3[0], tmp_path_factory.mktemp("qwen3"), "--instances", "2",
                          "--kv-cache-mib", "16") as cluster:
        yield cluster


def hf_greedy(qwen3, prompt: str, max_tokens: int) -> list[int]:
    model_dir, hf_model = qwen3
    prompt_ids = Tokenizer.from_dir(model_dir).encode(prompt)
    with torch.no_grad():
        output = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   do_sample=False, pad_token_id=0)
    return output[0, len(prompt_ids):].tolist()


async def test_greedy_tokens_equal_transformers(cluster, client, qwen3):
    for prompt in ("hello world", "the quick brown fox jumps"):
        completion = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=24,
                                                     temperature=0, extra_body={"return_token_ids": True,
                                                                                "ignore_eos": True})
        assert completion.choices[0].model_extra["token_ids"] == hf_greedy(qwen3, prompt, 24)


async def test_a_request_migrated_mid_stream_keeps_transformers_tokens(cluster, admin, client, qwen3):
    prompt, max_tokens = "a qwen request that moves", 400
    stream = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids, moved = [], None
    async for chunk in stream:
        if not chunk.choices:
            continue
        token_ids += chunk.choices[0].model_extra.get("token_ids") or []
        if moved is None and len(token_ids) >= 8:
            moved = await admin.Migrate(manager_pb2.MigrateRequest(request_id=chunk.id), timeout=60)
    assert moved is not None and moved.src_instance_id != moved.dst_instance_id and moved.num_blocks > 0
    assert token_ids == hf_greedy(qwen3, prompt, max_tokens)
