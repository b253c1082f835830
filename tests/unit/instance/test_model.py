"""The torch engine's Llama model against transformers, on tiny random checkpoints."""

import copy
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.instance.engine import attention
from services.instance.engine.block_manager import OUT_OF_WINDOW_BLOCK, num_blocks_out_of_window
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.model import LlamaModel, allocate_kv_cache, load_model
from services.instance.engine.context_window import checked_max_model_len, context_limit, kv_window, max_positions
from services.instance.engine.factory import EngineSpec, build_engine, fitted_max_model_len
from services.instance.engine.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from services.instance.engine.weights import checkpoint_files
from services.instance.engine.packed_linear import PackedLinear

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)  # 120 s: gemma2's two-thread test took 50 s of it at load 20

SHAPES = {
    # multi-head attention, separate LM head, default RoPE
    "mha_untied": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=320, tie_word_embeddings=False,
    ),
    # grouped-query attention, tied embeddings, non-default theta with llama3 scaling
    "gqa_tied": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2: biases on q/k/v (none on o), GQA, tied embeddings
    "qwen2_gqa": dict(
        architecture="Qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=400, tie_word_embeddings=True, use_sliding_window=False,
    ),
    # Qwen3: RMSNorm over each query and key head, a head_dim unrelated to hidden_size
    "qwen3_qk_norm": dict(
        architecture="Qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, vocab_size=400, tie_word_embeddings=False, use_sliding_window=False,
    ),
    # YaRN RoPE with DeepSeek's mscale pair, attention biases on q/k/v and o
    "llama_yarn": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=400, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                         "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 32},
    ),
    # Mistral with a sliding window far shorter than the test's sequences
    "mistral_window": dict(
        architecture="Mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=400, tie_word_embeddings=False, sliding_window=7,
    ),
    # Qwen2 with its sliding window on the layers from max_window_layers on
    "qwen2_window": dict(
        architecture="Qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=400, tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
        max_window_layers=1,
    ),
    # Phi-3: fused q/k/v and gate/up in the checkpoint, half the head rotated, longrope (short factors)
    "phi3_longrope": dict(
        architecture="Phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=400, tie_word_embeddings=False, sliding_window=9,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [3.0, 5.0, 7.0, 9.0],
            "original_max_position_embeddings": 64,
        },
    ),
    # Gemma: GeGLU, norms scaling by 1 + weight, embeddings scaled by sqrt(hidden_size), wide heads
    "gemma": dict(
        architecture="Gemma", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=400, tie_word_embeddings=True,
    ),
    # Gemma 2: norms around attention and MLP, soft-capped scores and logits, query_pre_attn_scalar,
    # a sliding window on alternate layers
    "gemma2": dict(
        architecture="Gemma2", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=400, tie_word_embeddings=True, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0, sliding_window=6,
    ),
    # Gemma 3: as Gemma 2 without soft-capping, a Gemma RMSNorm over each query and key head, and
    # the sliding layers (two of every three here) rotated by a RoPE of their own; linear scaling on the others
    "gemma3": dict(
        architecture="Gemma3Text", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=400, tie_word_embeddings=True, query_pre_attn_scalar=20,
        sliding_window=5, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
    ),
    # Granite: embedding, residual, attention and logits multipliers
    "granite": dict(
        architecture="Granite", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=400, tie_word_embeddings=True, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory) -> tuple[Path, object]:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def build_checkpoint(shape_name: str, path: Path) -> tuple[Path, object]:
    """A saved random model (Llama unless the shape names another architecture) and the
    transformers model it came from."""
    torch.manual_seed(0)
    shape = dict(SHAPES[shape_name])
    architecture = shape.pop("architecture", "Llama")
    hf_config = getattr(transformers, f"{architecture}Config")(
        **shape, max_position_embeddings=256, initializer_range=0.15,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _randomize_biases_and_norms(hf_model)
    hf_model.save_pretrained(path)
    return path, hf_model


def _randomize_biases_and_norms(hf_model) -> None:
    """transformers initializes biases to 0 and norms to 1: draw them, so they are tested."""
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.2)
            elif "norm" in name:
                parameter.normal_(1.0, 0.1)


@pytest.fixture(scope="module")
def model(checkpoint) -> LlamaModel:
    """Weights packed for oneDNN, as an instance loads them."""
    return load_model(checkpoint[0])


@dataclass
class Sequence:
    tokens: list[int]  # every token the sequence has, prompt and generated
    num_cached: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    num_dropped: int = 0  # leading blocks given back out of the sliding window (placeholders in `blocks`)


class PagedRunner:
    """Builds ForwardBatches the way a scheduler would, over shuffled, non-contiguous blocks. With a
    sliding window on every layer, the blocks behind a sequence's window go back before each step, and
    the next blocks allocated are those (so their K/V are overwritten at once): the block table keeps
    a placeholder, as the block manager does."""

    def __init__(self, model: LlamaModel, num_blocks: int = 96, block_size: int = 4, is_shuffled: bool = True,
                 gives_back: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.window = kv_window(model.config.layer_windows) if gives_back else None
        self.num_blocks_dropped = 0
        self.kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, dtype=model.dtype)
        self.free_blocks = list(reversed(range(num_blocks)))  # popped from the end: lowest id first
        if is_shuffled:
            random.Random(1).shuffle(self.free_blocks)

    def step(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run `n` uncached tokens of each sequence; returns the last-token logits."""
        return self.model(self.batch(work), self.kv_cache)

    def batch(self, work: list[tuple[Sequence, int]]) -> ForwardBatch:
        """The forward batch of `n` uncached tokens of each sequence (counted as cached from now on)."""
        ids, positions, slots = [], [], []
        for seq, n in work:
            self._drop_out_of_window(seq)
            new = range(seq.num_cached, seq.num_cached + n)
            while len(seq.blocks) * self.block_size < new.stop:
                seq.blocks.append(self.free_blocks.pop())
            ids += seq.tokens[new.start : new.stop]
            positions += new
            slots += [seq.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in new]
            seq.num_cached = new.stop
        max_blocks = max(len(seq.blocks) for seq, _ in work)
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_lens=[n for _, n in work],
            context_lens=torch.tensor([seq.num_cached for seq, _ in work]),
            block_tables=torch.tensor([seq.blocks + [0] * (max_blocks - len(seq.blocks)) for seq, _ in work]),
        )


    def _drop_out_of_window(self, seq: Sequence) -> None:
        num_out = min(num_blocks_out_of_window(seq.num_cached, self.block_size, self.window), len(seq.blocks))
        for i in range(seq.num_dropped, num_out):
            self.free_blocks.append(seq.blocks[i])  # popped next: another sequence writes into it at once
            seq.blocks[i] = OUT_OF_WINDOW_BLOCK
            self.num_blocks_dropped += 1
        seq.num_dropped = max(seq.num_dropped, num_out)

    def num_blocks_held(self, seq: Sequence) -> int:
        return len(seq.blocks) - seq.num_dropped


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_last_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, -1]


def test_packed_prefill_matches_transformers(checkpoint, model):
    _, hf_model = checkpoint
    prompts = [random_prompt(n, model.config.vocab_size, seed=n) for n in (1, 6, 13, 31)]
    logits = PagedRunner(model).step([(Sequence(p), len(p)) for p in prompts])
    assert logits.shape == (len(prompts), model.config.vocab_size)
    assert logits.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.fixture(params=["gathered", "in_place_fused", "in_place_per_head"])
def decode_path(request, monkeypatch) -> str:
    """gathered: decode sequences copy their blocks together first (these contexts are short);
    in_place_*: every decode sequence is read where its blocks lie, in segments of 8 keys,
    with all KV heads in one matmul (fused) or one matmul per head."""
    if request.param.startswith("in_place"):
        monkeypatch.setattr(attention, "IN_PLACE_MIN_KEYS", 1)
        monkeypatch.setattr(attention, "SEGMENT_KEYS", 8)
        monkeypatch.setattr(attention, "FUSED_MAX_KV_HEADS", 64 if request.param == "in_place_fused" else 0)
    return request.param


GREEDY_NUM_NEW = 24


@pytest.fixture(scope="module")
def greedy_prompts(checkpoint, model) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy prompt + GREEDY_NUM_NEW tokens) of each prompt: generated once per
    checkpoint, shared by the decode paths."""
    return transformers_greedy(checkpoint[1], model.config.vocab_size)


def transformers_greedy(hf_model, vocab_size: int) -> list[tuple[list[int], list[int]]]:
    prompts = [random_prompt(n, vocab_size, seed=100 + n) for n in (3, 11, 7, 19)]
    return [(prompt, hf_model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_NUM_NEW, do_sample=False,
                                       pad_token_id=0)[0].tolist()) for prompt in prompts]


def test_greedy_decoding_matches_generate(greedy_prompts, model, decode_path):
    assert_staggered_greedy_matches(greedy_prompts, model)


@pytest.mark.parametrize("shape_name", ["gemma2", "mistral_window"])
def test_greedy_decoding_on_two_torch_threads_matches_generate(shape_name, tmp_path):
    """The tests run one torch thread (tests/torch_threads.py); an instance may run more (--num-threads):
    two shapes on two threads, both sides."""
    path, hf_model = build_checkpoint(shape_name, tmp_path)
    torch.set_num_threads(2)
    try:
        model = load_model(path)
        assert_staggered_greedy_matches(transformers_greedy(hf_model, model.config.vocab_size), model)
    finally:
        torch.set_num_threads(1)


def assert_staggered_greedy_matches(greedy_prompts: list[tuple[list[int], list[int]]], model: LlamaModel) -> None:
    """Staggered arrivals mix prefill and decode sequences in one batch; one prompt is prefilled in chunks."""
    num_new = GREEDY_NUM_NEW
    prompts = [prompt for prompt, _ in greedy_prompts]
    seqs = [Sequence(list(p)) for p in prompts]
    runner = PagedRunner(model)
    num_generated = [0] * len(seqs)
    for step in range(num_new + 20):
        work = []
        for i, seq in enumerate(seqs[: step + 1]):
            remaining = len(seq.tokens) - seq.num_cached
            chunk = min(remaining, 5) if i == 3 else remaining  # the 19-token prompt goes in chunks of 5
            if num_generated[i] < num_new:
                work.append((i, chunk))
        if not work:
            break
        logits = runner.step([(seqs[i], n) for i, n in work])
        for (i, _), row in zip(work, logits):
            if seqs[i].num_cached == len(seqs[i].tokens):  # prompt fully cached: the logits predict a new token
                seqs[i].tokens.append(int(row.argmax()))
                num_generated[i] += 1
    assert num_generated == [num_new] * len(seqs)
    for (prompt, expected), seq in zip(greedy_prompts, seqs):
        assert len(expected) == len(prompt) + num_new
        assert seq.tokens == expected
    if runner.window is not None:  # a window on every layer: its blocks were given back and reused meanwhile
        assert runner.num_blocks_dropped == sum(seq.num_dropped for seq in seqs) >= 10
        max_held = -(-runner.window // runner.block_size) + 1
        assert all(runner.num_blocks_held(seq) <= max_held for seq in seqs), [runner.num_blocks_held(s) for s in seqs]


def test_chunked_prefill_matches_single_chunk(model):
    prompt = random_prompt(23, model.config.vocab_size, seed=7)
    whole = PagedRunner(model).step([(Sequence(prompt), len(prompt))])
    runner = PagedRunner(model, block_size=8)
    seq = Sequence(prompt)
    runner.step([(seq, 9)])
    chunked = runner.step([(seq, 14)])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [attention.DECODE_CHUNK_BYTES, 1])
def test_decode_logits_match_transformers(checkpoint, model, chunk_bytes, monkeypatch):
    """A decode-only batch of sequences with different context lengths, against full recomputation;
    also with every sequence gathered and attended in its own chunk."""
    monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", chunk_bytes)
    _, hf_model = checkpoint
    prompts = [random_prompt(n, model.config.vocab_size, seed=200 + n) for n in (4, 9, 17)]
    seqs = [Sequence(list(p)) for p in prompts]
    runner = PagedRunner(model, block_size=8)
    runner.step([(s, len(s.tokens) - 1) for s in seqs])
    logits = runner.step([(s, 1) for s in seqs])
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused_max_kv_heads", [0, 64])
@pytest.mark.parametrize("is_shuffled", [False, True])
def test_decode_read_in_place_matches_transformers(checkpoint, model, is_shuffled, fused_max_kv_heads, monkeypatch):
    """Decode sequences read in place, in segments of 8 keys: consecutive blocks (handed out in
    order; a decode step's new block follows other sequences' blocks) or shuffled ones, whose
    segments are gathered."""
    monkeypatch.setattr(attention, "IN_PLACE_MIN_KEYS", 8)
    monkeypatch.setattr(attention, "SEGMENT_KEYS", 8)
    monkeypatch.setattr(attention, "FUSED_MAX_KV_HEADS", fused_max_kv_heads)
    _, hf_model = checkpoint
    prompts = [random_prompt(n, model.config.vocab_size, seed=300 + n) for n in (5, 12, 17, 30)]
    seqs = [Sequence(list(p)) for p in prompts]
    # no block given back behind a window: one reused out of order would make unshuffled blocks not consecutive
    runner = PagedRunner(model, block_size=4, is_shuffled=is_shuffled, gives_back=False)
    for seq in seqs:  # one at a time, so each gets its blocks together
        runner.step([(seq, len(seq.tokens) - 1)])
    batch = runner.batch([(s, 1) for s in seqs])
    plan = attention.AttentionPlan.build(batch, attention.CacheGeometry.of(runner.kv_cache))
    assert plan.in_place is not None and plan.decode  # the 5-token prompt is too short for in place
    assert len(plan.in_place.sequences) == 3
    segments = [segment for seq in plan.in_place.sequences for segment in seq.segments]
    assert any(segment.slots is not None for segment in segments) == is_shuffled
    logits = model(batch, runner.kv_cache)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_segments_are_fixed_by_position_and_read_in_place_where_their_blocks_are_consecutive(monkeypatch):
    monkeypatch.setattr(attention, "SEGMENT_KEYS", 8)  # two blocks of 4
    block_table = torch.tensor([5, 6, 7, 2, 3, 9, 0, 0])  # padded past its blocks
    segments = attention._segments(block_table, 22, 4)
    assert [(s.first_slot, s.num_keys) for s in segments] == [(20, 8), (28, 8), (12, 6)]
    assert [s.slots is None for s in segments] == [True, False, False]
    assert segments[1].slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11]  # blocks 7 then 2
    assert segments[2].slots.tolist() == [12, 13, 14, 15, 36, 37]  # blocks 3 then 9, the last one partly
    assert [(s.first_slot, s.num_keys, s.slots) for s in attention._segments(block_table, 7, 4)] == [(20, 7, None)]


def test_sharded_checkpoint_loads_like_single_file(checkpoint, model, tmp_path):
    _, hf_model = checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    single = load_model(checkpoint[0], pack_weights=False).state_dict()
    sharded = load_model(tmp_path, pack_weights=False).state_dict()
    assert sharded.keys() == single.keys()
    assert any(".qkv_proj." in name for name in single)
    for name, tensor in single.items():
        torch.testing.assert_close(sharded[name], tensor, atol=0, rtol=0)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_pytorch_bin_checkpoint_loads_like_safetensors(checkpoint, num_shards, tmp_path):
    """Older checkpoints: `pytorch_model.bin`, or shards listed in `pytorch_model.bin.index.json`
    (as transformers wrote them before safetensors; it no longer does, so they are written here)."""
    (tmp_path / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    tensors = checkpoint[1].state_dict()
    names = sorted(tensors)
    if num_shards == 1:
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    else:
        files = [f"pytorch_model-0000{i + 1}-of-00002.bin" for i in range(2)]
        halves = [names[: len(names) // 2], names[len(names) // 2:]]
        for file, half in zip(files, halves):
            torch.save({name: tensors[name].clone() for name in half}, tmp_path / file)
        weight_map = {name: file for file, half in zip(files, halves) for name in half}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    single = load_model(checkpoint[0], pack_weights=False).state_dict()
    from_bin = load_model(tmp_path, pack_weights=False).state_dict()
    assert from_bin.keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(from_bin[name], tensor, atol=0, rtol=0)


def test_safetensors_win_over_a_pickle_index_left_beside_them(tiny_model_dir, tmp_path):
    """`huggingface-cli download --include '*.json' '*.safetensors'` of a repo that also ships .bin shards."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    names = checkpoint_files(folder)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {name: "pytorch_model-00001-of-00002.bin" for name in names}}))
    assert all(path.suffix == ".safetensors" for path in checkpoint_files(folder).values())


def test_a_pickle_that_is_not_tensors_is_refused(checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a PyTorch checkpoint of tensors"):
        load_model(tmp_path, pack_weights=False)


def test_packed_weights_give_the_same_logits(checkpoint, model):
    plain = load_model(checkpoint[0], pack_weights=False)
    assert model.lm_head is not None and model.lm_head.packed_weight is not None  # the fixture's model is packed
    assert plain.lm_head is None or plain.lm_head.packed_weight is None
    prompts = [random_prompt(n, model.config.vocab_size, seed=50 + n) for n in (3, 12)]
    expected = PagedRunner(plain).step([(Sequence(p), len(p)) for p in prompts])
    logits = PagedRunner(model).step([(Sequence(p), len(p)) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, PackedLinear))  # tiny ones too


def test_bfloat16_load_gives_float32_logits(checkpoint):
    path, hf_model = checkpoint
    model = load_model(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    prompt = random_prompt(10, model.config.vocab_size, seed=3)
    logits = PagedRunner(model).step([(Sequence(prompt), len(prompt))])
    assert logits.dtype == torch.float32
    expected = hf_last_logits(hf_model, prompt)
    # bfloat16 rounding grows with depth and norms: allow twice what transformers' own bfloat16 run is off by
    hf_bf16_error = float((hf_last_logits(copy.deepcopy(hf_model).to(torch.bfloat16), prompt).float() - expected)
                          .abs().max())
    torch.testing.assert_close(logits[0], expected, atol=max(0.15, 2 * hf_bf16_error), rtol=0.05)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    missing = sorted(name for name in tensors if name.startswith("model.layers.1.mlp."))[-1]
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_model(tmp_path)


def base_config(**changes) -> dict:
    raw = {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "rope_theta": 100000, "rope_scaling": None, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": [2, 7], "torch_dtype": "bfloat16",
    }
    raw.update(changes)
    return raw


def test_config_reads_old_style_fields():
    config = ModelConfig.from_dict(base_config())
    assert config.head_dim == 64
    assert config.rope.theta == 100000.0 and config.rope.rope_type == "default" and config.rope.rotary_dim == 64
    assert config.context_length == 8192
    assert config.eos_token_ids == (2, 7)
    assert config.num_queries_per_kv == 3
    assert config.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict(base_config(eos_token_id=2)).eos_token_ids == (2,)


def test_config_reads_checkpoint(checkpoint):
    path, hf_model = checkpoint
    config = ModelConfig.from_dir(path)
    assert config.num_key_value_heads == hf_model.config.num_key_value_heads
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    rope_parameters = hf_model.config.rope_parameters
    assert config.rope.theta == rope_parameters.get("full_attention", rope_parameters)["rope_theta"]
    window = getattr(hf_model.config, "sliding_window", None)
    layer_types = getattr(hf_model.config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    assert list(config.layer_windows) == [window if kind == "sliding_attention" else None for kind in layer_types]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_type": "bloom"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, "ntk-by-parts"),
        ({"hidden_act": "quick_gelu"}, "hidden_act"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.3}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.5, "rope_scaling": {"type": "linear", "factor": 2.0}}, "only phi3"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: quantized checkpoints"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "longrope"),
    ],
)
def test_config_rejects_unsupported(changes, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(base_config(**changes))


def test_fields_left_out_take_transformers_per_family_defaults():
    without = {"head_dim": None, "rms_norm_eps": None}
    for model_type, head_dim in (("llama", 64), ("qwen3", 128), ("gemma", 256), ("gemma2", 256),
                                 ("gemma3_text", 256)):
        raw = {k: v for k, v in base_config(model_type=model_type).items() if k not in without}
        assert ModelConfig.from_dict(raw).head_dim == head_dim, model_type
    phi3 = {k: v for k, v in base_config(model_type="phi3").items() if k not in without}
    assert ModelConfig.from_dict(phi3).norm_eps == 1e-5
    mistral = ModelConfig.from_dict(base_config(model_type="mistral"))
    assert set(mistral.layer_windows) == {4096}  # MistralConfig's sliding_window


HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                     "phi3": "Phi3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "granite": "GraniteConfig",
                     "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                     "olmo2": "Olmo2Config", "olmoe": "OlmoeConfig"}


@pytest.mark.parametrize("model_type", sorted(HF_CONFIG_CLASSES))
def test_a_left_out_norm_epsilon_and_rope_theta_take_transformers_defaults(model_type):
    """Found by a review: Mixtral's are 1e-5 and 1e6, not the Llama family's 1e-6 and 1e4."""
    transformers = pytest.importorskip("transformers")
    reference = getattr(transformers, HF_CONFIG_CLASSES[model_type])()
    raw = {k: v for k, v in base_config(model_type=model_type, moe_intermediate_size=64).items()
           if k not in ("rms_norm_eps", "rope_theta")}
    config = ModelConfig.from_dict(raw)
    assert config.norm_eps == reference.rms_norm_eps
    assert config.rope.theta == reference.rope_parameters["rope_theta"]


def test_gemma3_keeps_attn_logit_softcapping_unapplied_as_transformers_does():
    gemma3 = ModelConfig.from_dict(base_config(model_type="gemma3_text", head_dim=64, attn_logit_softcapping=0.5))
    gemma2 = ModelConfig.from_dict(base_config(model_type="gemma2", head_dim=64, attn_logit_softcapping=0.5))
    assert gemma3.attention_softcap is None and gemma2.attention_softcap == 0.5


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "granite", "mistral"])
def test_only_phi3_rotates_part_of_each_head(model_type):
    """transformers' other families rotate the whole head whatever partial_rotary_factor says."""
    config = ModelConfig.from_dict(base_config(model_type=model_type, partial_rotary_factor=0.5))
    assert config.rope.rotary_dim == config.head_dim
    phi3 = ModelConfig.from_dict(base_config(model_type="phi3", partial_rotary_factor=0.5))
    assert phi3.rope.rotary_dim == phi3.head_dim // 2


@pytest.mark.parametrize(("changes", "qkv_bias", "o_bias", "qk_norm"), [
    ({}, False, False, False),
    ({"attention_bias": True}, True, True, False),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, True, False, False),
    ({"model_type": "qwen3", "layer_types": ["full_attention"] * 30}, False, False, True),
])
def test_config_reads_each_familys_attention_extras(changes, qkv_bias, o_bias, qk_norm):
    config = ModelConfig.from_dict(base_config(**changes))
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (qkv_bias, o_bias, qk_norm)


@pytest.mark.parametrize(("changes", "length", "set_by"), [
    ({}, 8192, "max_position_embeddings"),
    ({"model_type": "mistral", "sliding_window": 4096}, 8192, "max_position_embeddings"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 24, "long_factor": [2.0] * 24}}, 4096, "longrope"),
])
def test_context_length_stops_where_the_rope_stops_being_exact(changes, length, set_by):
    config = ModelConfig.from_dict(base_config(**changes))
    assert config.context_length == length and set_by in config.context.set_by
    assert checked_max_model_len(0, config.context) == length
    assert checked_max_model_len(length - 1, config.context) == length - 1
    with pytest.raises(ValueError, match=f"--max-model-len {length + 1} .*{length} tokens.*{set_by}"):
        checked_max_model_len(length + 1, config.context)


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize(("changes", "windows"), [
    ({}, [None] * 4),
    ({"sliding_window": 1024}, [None] * 4),  # Llama has no window: the field is ignored
    ({"model_type": "mistral", "sliding_window": 4096}, [4096] * 4),
    ({"model_type": "mistral", "sliding_window": None}, [None] * 4),
    ({"model_type": "phi3", "sliding_window": 2047}, [2047] * 4),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64}, [None] * 4),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
     [None, None, 64, 64]),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64, "layer_types": [S, F, S, F]},
     [64, None, 64, None]),
    ({"model_type": "gemma2"}, [4096, None, 4096, None]),  # transformers' defaults
    ({"model_type": "gemma2", "sliding_window": 8, "layer_types": [F, F, F, S]}, [None, None, None, 8]),
])
def test_config_reads_each_layers_sliding_window(changes, windows):
    config = ModelConfig.from_dict(base_config(num_hidden_layers=4, **changes))
    assert list(config.layer_windows) == windows
    assert config.context_length == 8192


@pytest.mark.parametrize(("changes", "activation"), [
    ({}, "silu"), ({"hidden_act": "gelu"}, "gelu"),
    ({"model_type": "gemma", "hidden_act": "gelu"}, "gelu_pytorch_tanh"),  # Gemma's legacy spelling
    ({"model_type": "gemma", "hidden_act": None}, "gelu_pytorch_tanh"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
    ({"hidden_act": "gelu_fast"}, "gelu_pytorch_tanh"), ({"hidden_act": "swish"}, "silu"),  # transformers' aliases
    ({"hidden_act": "gelu_new"}, "gelu_new"),  # its own formula: other bits than gelu_pytorch_tanh
])
def test_config_reads_the_activation(changes, activation):
    raw = base_config(**changes)
    raw = {key: value for key, value in raw.items() if value is not None}
    assert ModelConfig.from_dict(raw).activation == activation


def test_gemma3_reads_the_old_rope_spelling_per_layer_type():
    config = ModelConfig.from_dict(base_config(
        model_type="gemma3_text", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=512,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, num_hidden_layers=6, head_dim=32))
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("linear", 1_000_000.0, 8.0)
    assert (config.sliding_rope.rope_type, config.sliding_rope.theta) == ("default", 10_000.0)
    assert list(config.layer_windows) == [512] * 5 + [None]  # five local layers, then a global one
    assert config.qk_norm and config.sandwich_norms and config.attention_softcap is None


def test_gemma3_sliding_rope_defaults_to_the_local_base_not_the_global_theta():
    config = ModelConfig.from_dict(base_config(
        model_type="gemma3_text", rope_theta=500_000.0, rope_local_base_freq=20_000.0, head_dim=32,
        rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}))
    assert (config.rope.theta, config.sliding_rope.theta) == (500_000.0, 20_000.0)


def test_dynamic_rope_is_plain_rope_within_the_context():
    config = ModelConfig.from_dict(base_config(rope_scaling={"type": "dynamic", "factor": 4.0}))
    assert config.rope == ModelConfig.from_dict(base_config()).rope


def test_config_json_is_required(tmp_path):
    (tmp_path / "unrelated.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_an_instance_serves_no_longer_sequences_than_its_kv_cache_holds(tiny_model_dir):
    """The model's own context is lowered to what the cache holds (a request alone must always be
    able to finish: before, one past it was cut short with finish_reason length); an explicit
    --max-model-len above it is refused at startup."""
    assert fitted_max_model_len(8192, is_explicit=False, kv_tokens=5824) == 5824
    assert fitted_max_model_len(2048, is_explicit=False, kv_tokens=5824) == 2048
    with pytest.raises(ValueError, match="--max-model-len 8192 does not fit the KV cache, which holds 5824 tokens"):
        fitted_max_model_len(8192, is_explicit=True, kv_tokens=5824)
    loaded = build_engine(EngineSpec(tiny_model_dir, kv_name=f"ferry-kv-fit-{os.getpid()}", num_blocks=8, block_size=4))
    try:
        assert loaded.max_model_len == 32 and loaded.engine.config.max_model_len == 32
    finally:
        loaded.close()
    with pytest.raises(ValueError, match="--kv-cache-mib"):
        build_engine(EngineSpec(tiny_model_dir, kv_name=f"ferry-kv-fit-{os.getpid()}", num_blocks=8, block_size=4,
                                max_model_len=64))


def test_tensors_that_disagree_with_the_config_name_the_fields_to_check(tiny_model_dir, tmp_path):
    folder = tmp_path / "mismatch"
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": raw["intermediate_size"] * 2}))
    with pytest.raises(ValueError, match="do not have the shapes config.json gives .*intermediate_size.*size mismatch"):
        LlamaModel.from_pretrained(folder)


@pytest.mark.parametrize("head_differs", [True, False])
def test_a_tied_model_says_when_it_ignores_a_checkpoint_head_that_differs(tiny_model_dir, tmp_path, head_differs):
    """tie_word_embeddings makes the head the embedding matrix (as vLLM); a checkpoint's own `lm_head.weight`
    that differs from it is unused, and transformers 5 would serve it: the log must say so."""
    from structlog.testing import capture_logs
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding + 1 if head_differs else embedding.clone()
    save_file(weights, folder / "model.safetensors")
    with capture_logs() as logs:
        model = load_model(folder, pack_weights=False)
    warned = [e for e in logs if e["event"] == "tied_lm_head_ignored"]
    assert model.lm_head is None and len(warned) == int(head_differs)


WINDOWED_HF_CONFIG_CLASSES = {"mistral": "MistralConfig", "mixtral": "MixtralConfig", "phi3": "Phi3Config",
                              "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma2": "Gemma2Config",
                              "gemma3_text": "Gemma3TextConfig", "starcoder2": "Starcoder2Config"}


@pytest.mark.parametrize("model_type", sorted(WINDOWED_HF_CONFIG_CLASSES))
def test_a_left_out_sliding_window_takes_transformers_default(model_type):
    """Found by a black-box run: a Qwen2/Qwen3 config.json with `use_sliding_window` and no `sliding_window`
    was served with no window at all, where transformers reads its default 4096 on the layers from
    `max_window_layers` on (the outputs parted past 4096 tokens)."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in base_config(model_type=model_type, num_hidden_layers=6, head_dim=64, use_sliding_window=True,
                                        max_window_layers=2).items() if k != "sliding_window"}
    reference = getattr(transformers, WINDOWED_HF_CONFIG_CLASSES[model_type])(
        **{k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype", "eos_token_id")})
    window = reference.sliding_window
    layer_types = getattr(reference, "layer_types", None) or [S] * 6
    assert list(ModelConfig.from_dict(raw).layer_windows) == [window if kind == S else None for kind in layer_types]


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_left_out_max_position_embeddings_takes_the_family_s_transformers_default(model_type):
    """Found by a black-box run: every family was served 2048 positions (Llama's default) where config.json
    has none, and yarn's original length was read from it; transformers' defaults differ per family."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoConfig.for_model(model_type)
    expected = reference.n_positions if model_type == "gpt2" else reference.max_position_embeddings
    raw = {"model_type": model_type}
    assert (max_positions(raw), context_limit(raw).length) == (expected, expected)
