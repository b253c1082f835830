"""A long decode sequence's attention does not depend on where its blocks lie, in any cache
dtype: a migrated request lands in other blocks than it had, and must get the same tokens."""

import pytest
import torch

from services.instance.engine import attention
from services.instance.engine.forward_batch import ForwardBatch

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 16, 2, 3, 32
CONTEXT = 1100  # past IN_PLACE_MIN_KEYS
NUM_SEQ_BLOCKS = (CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE
NUM_CACHE_BLOCKS = 3 * NUM_SEQ_BLOCKS


def _layouts() -> dict[str, list[int]]:
    """Block tables for one sequence: consecutive (1 run), three runs, scattered."""
    third = NUM_SEQ_BLOCKS // 3
    runs = [*range(100, 100 + third), *range(10, 10 + third), *range(150, 150 + NUM_SEQ_BLOCKS - 2 * third)]
    scattered = torch.randperm(NUM_CACHE_BLOCKS, generator=torch.Generator().manual_seed(0))[:NUM_SEQ_BLOCKS]
    return {"one run": list(range(5, 5 + NUM_SEQ_BLOCKS)), "three runs": runs, "scattered": scattered.tolist()}


def _attend(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, block_table: list[int],
            dtype: torch.dtype) -> tuple[torch.Tensor, attention.AttentionPlan]:
    """The one decode query over `keys`/`values` [CONTEXT, kv_heads, head_dim] stored in `block_table`."""
    kv_layer = torch.zeros(2, NUM_CACHE_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = torch.tensor([block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(CONTEXT)])
    kv_layer[0, slots], kv_layer[1, slots] = keys.to(dtype), values.to(dtype)
    kv_layer = kv_layer.view(2, NUM_CACHE_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    batch = ForwardBatch(input_ids=torch.tensor([0]), positions=torch.tensor([CONTEXT - 1]),
                         slot_mapping=slots[-1:], query_lens=[1], context_lens=torch.tensor([CONTEXT]),
                         block_tables=torch.tensor([block_table]))
    plan = attention.AttentionPlan.build(batch, attention.CacheGeometry.of(kv_layer.unsqueeze(0)))
    return attention.attend(q.to(dtype), kv_layer, plan, HEAD_DIM**-0.5), plan


def _reference(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """In float64, from the inputs as rounded to `dtype`."""
    keys, values, q = (x.to(dtype).double() for x in (keys, values, q))
    k, v = keys.repeat_interleave(GROUP, 1), values.repeat_interleave(GROUP, 1)
    probs = torch.softmax(torch.einsum("hd,khd->hk", q[0], k) * HEAD_DIM**-0.5, dim=-1)
    return torch.einsum("hk,khd->hd", probs, v).flatten()[None]


@pytest.mark.parametrize(("dtype", "max_error"), [(torch.bfloat16, 0.02), (torch.float16, 0.002)])
def test_a_low_precision_cache_gives_the_same_attention_in_any_layout(dtype, max_error):
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(CONTEXT, NUM_KV_HEADS, HEAD_DIM, generator=generator) * 2 for _ in range(2))
    q = torch.randn(1, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator) * 2
    outputs = {}
    for name, block_table in _layouts().items():
        outputs[name], plan = _attend(keys, values, q, block_table, dtype)
        assert plan.in_place is None  # gathered: SDPA accumulates in float32
    assert torch.equal(outputs["one run"], outputs["three runs"]) and torch.equal(outputs["one run"],
                                                                                   outputs["scattered"])
    error = (outputs["one run"].double() - _reference(keys, values, q, dtype)).abs().max()
    assert error < max_error  # read in place, in the cache's dtype: 0.054 in bfloat16, 0.0083 in float16


@pytest.mark.parametrize("fused_max_kv_heads", [0, 64])
def test_a_float32_cache_is_read_in_place_with_the_same_bits_in_any_layout(fused_max_kv_heads, monkeypatch):
    """Segments whose blocks are consecutive are read where they lie, the others gathered: the
    same bits either way (before, the sum went run by run, so other runs gave other bits)."""
    monkeypatch.setattr(attention, "FUSED_MAX_KV_HEADS", fused_max_kv_heads)
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(CONTEXT, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    q = torch.randn(1, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    outputs = {}
    for name, block_table in _layouts().items():
        outputs[name], plan = _attend(keys, values, q, block_table, torch.float32)
        assert plan.in_place is not None
    assert torch.equal(outputs["one run"], outputs["three runs"]) and torch.equal(outputs["one run"],
                                                                                   outputs["scattered"])
    reference = _reference(keys, values, q, torch.float32)
    torch.testing.assert_close(outputs["one run"].double(), reference, atol=1e-5, rtol=1e-5)


def test_a_plan_moved_to_a_device_takes_every_tensor_a_layer_reads():
    """On a GPU the plan's index tensors must be there too (a gathered segment's slots included)."""
    kv_layer = torch.zeros(2, NUM_CACHE_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_table = _layouts()["scattered"]
    batch = ForwardBatch(input_ids=torch.tensor([0, 0]), positions=torch.tensor([CONTEXT - 1, 9]),
                         slot_mapping=torch.tensor([0, 1]), query_lens=[1, 1], context_lens=torch.tensor([CONTEXT, 10]),
                         block_tables=torch.tensor([block_table, block_table]))
    plan = attention.AttentionPlan.build(batch, attention.CacheGeometry.of(kv_layer.unsqueeze(0))).to(
        torch.device("meta"))
    tensors = [plan.slot_mapping, plan.in_place.out_index,
               *(s.slots for seq in plan.in_place.sequences for s in seq.segments if s.slots is not None),
               *(t for group in plan.decode for t in (*group.gather_indices, group.mask, group.token_index,
                                                      group.out_index) if t is not None)]
    assert any(s.slots is not None for seq in plan.in_place.sequences for s in seq.segments)
    assert tensors and all(t.device.type == "meta" for t in tensors)


def test_a_decode_sequence_gets_the_same_bits_alone_and_in_a_batch_on_two_threads():
    """SDPA's CPU kernel gives a (sequence, KV head) pair other bits on its second OpenMP thread than on its
    first (its per-thread scratch), and which thread takes a pair depends on the pairs before it in the call:
    on two threads a decode sequence attended alone and third in a batch of seven differed in the last bits
    (the tests' one thread hid it). Decode attention runs on one thread."""
    generator = torch.Generator().manual_seed(3)
    num_seqs, context = 7, 90
    num_blocks = -(-context // BLOCK_SIZE)
    kv_layer = torch.randn(2, num_seqs * num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    q = torch.randn(num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    tables = torch.arange(num_seqs * num_blocks).view(num_seqs, num_blocks)

    def attend(seqs: list[int]) -> torch.Tensor:
        batch = ForwardBatch(input_ids=torch.zeros(len(seqs), dtype=torch.int64),
                             positions=torch.full((len(seqs),), context - 1), slot_mapping=tables[seqs, -1] * BLOCK_SIZE,
                             query_lens=[1] * len(seqs), context_lens=torch.full((len(seqs),), context),
                             block_tables=tables[seqs])
        plan = attention.AttentionPlan.build(batch, attention.CacheGeometry.of(kv_layer.unsqueeze(0)))
        return attention.attend(q[seqs], kv_layer, plan, HEAD_DIM**-0.5)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        in_batch = attend(list(range(num_seqs)))
        alone = [attend([seq]) for seq in range(num_seqs)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(in_batch[seq:seq + 1], alone[seq]) for seq in range(num_seqs))
