import pytest

from services.common.errors import InvalidArgument
from services.transfer.chunk_plan import ChunkPlan, check_block_ids, check_compatible
from tests.unit.transfer.factories import tiny_geometry

pytestmark = pytest.mark.timeout(30)

ROW_BYTES = 4 * 2 * 8 * 2  # 128 bytes
BLOCK_BYTES = ROW_BYTES * 4  # 512 bytes


def test_whole_blocks_fill_the_staging_buffer():
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=7, staging_bytes=3 * BLOCK_BYTES + 100)
    chunks = list(plan.chunks())
    assert plan.blocks_per_chunk == 3 and plan.rows_per_chunk == 4
    assert [(c.block_start, c.block_stop) for c in chunks] == [(0, 3), (3, 6), (6, 7)]
    assert all((c.row_start, c.row_stop) == (0, 4) for c in chunks)
    assert sum(plan.chunk_bytes(c) for c in chunks) == plan.num_bytes == 7 * BLOCK_BYTES
    assert [c.index for c in chunks] == [0, 1, 2]


def test_blocks_bigger_than_the_buffer_are_split_by_rows_in_order():
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=2, staging_bytes=3 * ROW_BYTES)
    chunks = list(plan.chunks())
    assert [(c.block_start, c.row_start, c.row_stop) for c in chunks] == [(0, 0, 3), (0, 3, 4), (1, 0, 3), (1, 3, 4)]
    assert max(plan.chunk_bytes(c) for c in chunks) <= 3 * ROW_BYTES


def test_buffer_smaller_than_a_row_is_refused_with_the_flag_to_raise():
    with pytest.raises(InvalidArgument, match="--staging-kib"):
        ChunkPlan.for_staging(tiny_geometry(), num_blocks=1, staging_bytes=ROW_BYTES - 1)


def test_header_plan_matches_the_senders():
    sender = ChunkPlan.for_staging(tiny_geometry(), num_blocks=5, staging_bytes=2 * BLOCK_BYTES)
    receiver = ChunkPlan.from_header(tiny_geometry(num_blocks=40), 5, sender.blocks_per_chunk, sender.rows_per_chunk)
    assert list(receiver.chunks()) == list(sender.chunks())


def test_geometries_must_match_except_num_blocks():
    check_compatible(tiny_geometry(num_blocks=3), tiny_geometry(num_blocks=9))
    import torch
    with pytest.raises(InvalidArgument, match="dtype"):
        check_compatible(tiny_geometry(), tiny_geometry(dtype=torch.float32))


def test_block_ids_in_range_and_unique_destinations():
    check_block_ids((0, 5, 5), 6, "src_block_ids", is_unique=False)
    with pytest.raises(InvalidArgument, match="outside"):
        check_block_ids((6,), 6, "dst_block_ids", is_unique=True)
    with pytest.raises(InvalidArgument, match="duplicate"):
        check_block_ids((1, 1), 6, "dst_block_ids", is_unique=True)
