import random

import pytest
import torch

from services.common.errors import Aborted
from services.instance.engine.kv_cache import KvGeometry
from services.transfer.block_copy import gather_chunk, staged_view
from services.transfer.checksum import ChecksumVerifier, block_checksums, gathered_checksums
from services.transfer.chunk_plan import ChunkPlan
from tests.unit.transfer.factories import random_kv, rows_of, tiny_geometry

pytestmark = pytest.mark.timeout(30)

IDS = (5, 0, 9)


def _stage_all(kv, plan, corrupt_chunk=None):
    buffer = torch.zeros(plan.max_chunk_bytes, dtype=torch.uint8)
    for chunk in plan.chunks():
        staged = gather_chunk(rows_of(kv), torch.tensor(IDS), chunk, staged_view(buffer, plan, chunk, kv.dtype))
        if chunk.index == corrupt_chunk:
            staged.view(torch.uint8).view(-1)[3] ^= 1  # one flipped bit
        yield chunk, staged


@pytest.mark.parametrize("staging_bytes", [4096, 128, 256])  # whole blocks; rows split 1 and 2 at a time
def test_checksums_chain_over_row_chunks(staging_bytes):
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=5)
    plan = ChunkPlan.for_staging(geometry, len(IDS), staging_bytes)
    verifier = ChecksumVerifier(plan, block_checksums(rows_of(kv), IDS))
    for chunk, staged in _stage_all(kv, plan):
        verifier.update(chunk, staged)


def test_a_flipped_bit_aborts():
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=6)
    plan = ChunkPlan.for_staging(geometry, len(IDS), 128)
    verifier = ChecksumVerifier(plan, block_checksums(rows_of(kv), IDS))
    with pytest.raises(Aborted, match="checksum mismatch"):
        for chunk, staged in _stage_all(kv, plan, corrupt_chunk=5):
            verifier.update(chunk, staged)


def test_checksums_differ_between_blocks_and_are_off_when_empty():
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=7)
    assert len(set(block_checksums(rows_of(kv), (0, 1, 2)))) == 3
    assert not ChecksumVerifier(ChunkPlan.for_staging(geometry, 1, 4096), ()).is_enabled


def _flip(kv: torch.Tensor, block_id: int, row: int, bit: int) -> None:
    """Flip one bit of one row of one block of `kv` in place (`bit` counts from the row's first byte)."""
    rows_of(kv)[row, block_id].view(torch.uint8)[bit // 8] ^= 1 << bit % 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_a_flipped_bit_in_any_row_of_any_block_changes_that_blocks_checksum_alone(dtype):
    """Every bit of block 5, and a random bit of every row of every block: that block's checksum changes, the
    others' do not."""
    geometry = tiny_geometry(dtype=dtype)
    kv = random_kv(geometry, seed=8)
    num_rows, row_bits = rows_of(kv).shape[0], rows_of(kv)[0, 0].view(torch.uint8).numel() * 8
    rng = random.Random(8)
    every_bit = [((4, 5, 6), 5, row, bit) for row in range(num_rows) for bit in range(row_bits)]
    every_block = [(tuple(range(geometry.num_blocks)), block_id, row, rng.randrange(row_bits))
                   for block_id in range(geometry.num_blocks) for row in range(num_rows)]
    before = {ids: block_checksums(rows_of(kv), ids) for ids, *_ in every_bit[:1] + every_block[:1]}
    for ids, block_id, row, bit in every_bit + every_block:
        _flip(kv, block_id, row, bit)
        after = block_checksums(rows_of(kv), ids)
        _flip(kv, block_id, row, bit)
        assert [i for i, a, b in zip(ids, after, before[ids]) if a != b] == [block_id], (block_id, row, bit)


def test_a_flipped_bit_in_a_row_of_an_odd_number_of_bytes_changes_its_checksum():
    geometry = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=3, block_size=1, num_blocks=4, dtype=torch.float16)
    kv = random_kv(geometry, seed=9)  # rows of 6 bytes
    before = block_checksums(rows_of(kv), (2,))
    for row, bit in [(row, bit) for row in range(2) for bit in range(48)]:
        _flip(kv, 2, row, bit)
        assert block_checksums(rows_of(kv), (2,)) != before, (row, bit)
        _flip(kv, 2, row, bit)


def test_blocks_gathered_a_few_at_a_time_have_the_same_checksums(monkeypatch):
    """A GPU cache's blocks go to the host at most GATHER_BYTES at a time (here the host stands in for the GPU):
    the crcs are the direct ones, and no copy holds more than the bound (one block at least)."""
    geometry = tiny_geometry()
    rows = rows_of(random_kv(geometry, seed=7))
    ids = tuple(random.Random(3).choices(range(geometry.num_blocks), k=11))
    gathered: list[int] = []
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, *args: gathered.append(len(args[1])) or index_select(self, *args))
    for max_bytes, per_copy in ((3 * geometry.bytes_per_block, 3), (1, 1), (1 << 30, 11)):
        gathered.clear()
        assert gathered_checksums(rows, ids, max_bytes) == block_checksums(rows, ids)
        assert max(gathered) == per_copy and sum(gathered) == len(ids)
