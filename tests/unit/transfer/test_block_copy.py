import pytest
import torch

from services.common.errors import InvalidArgument
from services.transfer.block_copy import (as_bytes, block_runs, chunk_parts, copy_blocks, gather_chunk,
                                          scatter_chunk, staged_view)
from services.transfer.chunk_plan import ChunkPlan, paired_runs
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads
from tests.unit.transfer.factories import random_kv, rows_of, tiny_geometry
from tests.unit.transfer.test_channel_window import BLOCK_BYTES, FakeMappings

pytestmark = pytest.mark.timeout(30)

SRC_IDS = (7, 2, 3, 4, 11, 0)  # reordered, with a run in the middle
DST_IDS = (1, 9, 10, 11, 5, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("staging_rows", [1000, 8, 1, 3])  # all blocks, 2 blocks, 1 row, 3 rows (4 rows a block)
def test_gather_then_scatter_moves_blocks_bit_exactly(dtype, staging_rows):
    geometry = tiny_geometry(dtype=dtype)
    staging_bytes = staging_rows * geometry.bytes_per_block // 4
    src, dst = random_kv(geometry, seed=1), random_kv(geometry, seed=2)
    expected = dst.clone()
    for s, d in zip(SRC_IDS, DST_IDS):
        expected[:, :, d] = src[:, :, s]
    plan = ChunkPlan.for_staging(geometry, len(SRC_IDS), staging_bytes)
    buffer = torch.zeros(staging_bytes, dtype=torch.uint8)  # one preallocated buffer, reused by every chunk
    src_ids = torch.tensor(SRC_IDS)
    for chunk in plan.chunks():
        staged = gather_chunk(rows_of(src), src_ids, chunk, staged_view(buffer, plan, chunk, dtype))
        assert staged.data_ptr() == buffer.data_ptr()  # gathered in place, no fresh allocation
        scatter_chunk(rows_of(dst), DST_IDS, chunk, staged)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("staging_rows", [1000, 8, 1, 3])
def test_joined_chunk_parts_are_the_staged_bytes(staging_rows):
    geometry = tiny_geometry(dtype=torch.bfloat16)
    staging_bytes = staging_rows * geometry.bytes_per_block // 4
    src = random_kv(geometry, seed=5)
    plan = ChunkPlan.for_staging(geometry, len(SRC_IDS), staging_bytes)
    buffer = torch.zeros(staging_bytes, dtype=torch.uint8)
    for chunk in plan.chunks():
        staged = gather_chunk(rows_of(src), torch.tensor(SRC_IDS), chunk, staged_view(buffer, plan, chunk, src.dtype))
        joined = b"".join(chunk_parts(as_bytes(rows_of(src)), SRC_IDS, chunk))
        assert joined == as_bytes(staged).tobytes()


def test_direct_copy_moves_blocks_and_leaves_the_rest():
    geometry = tiny_geometry()
    src, dst = random_kv(geometry, seed=3), random_kv(geometry, seed=4)
    expected = dst.clone()
    for s, d in zip(SRC_IDS, DST_IDS):
        expected[:, :, d] = src[:, :, s]
    copy_blocks(rows_of(src), SRC_IDS, rows_of(dst), DST_IDS)
    assert torch.equal(dst, expected)


def test_runs_coalesce_consecutive_ids():
    assert list(block_runs((4, 5, 6, 1, 2, 9))) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert list(paired_runs((1, 2, 3, 7), (5, 6, 8, 9))) == [(0, 2), (2, 3), (3, 4)]


async def test_a_shm_copy_within_one_instance_that_writes_blocks_it_reads_is_refused():
    """Runs are copied in place: src (0, 1) -> dst (1, 2) would read block 1 after writing it."""
    geometry = tiny_geometry(num_blocks=8)
    kv = random_kv(geometry, 1)
    original = kv.clone()
    threads = TransferThreads.start(1)
    try:
        sender = BlockSender("a", (TransferBackend.SHM,), FakeMappings({"i": kv}, geometry),
                             StagingPool(1, BLOCK_BYTES, 2), None, None, threads)
        overlapping = BlockTransfer(InstanceId("i"), (0, 1), InstanceId("i"), (1, 2), "", TransferBackend.SHM, False)
        with pytest.raises(InvalidArgument, match="must not write blocks it reads"):
            await sender.transfer(overlapping, 5)
        assert torch.equal(kv, original)
        apart = BlockTransfer(InstanceId("i"), (0, 1), InstanceId("i"), (5, 6), "", TransferBackend.SHM, False)
        await sender.transfer(apart, 5)
        assert torch.equal(kv[:, :, [5, 6]], original[:, :, [0, 1]])
    finally:
        threads.shutdown()
