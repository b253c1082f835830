import pytest

from services.common.errors import InvalidArgument
from services.transfer.chunk_plan import ChunkPlan, check_block_ids, check_compatible, find_in_place_spans
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


def test_in_place_spans_are_runs_with_rows_long_enough():
    geometry = tiny_geometry(num_blocks=40)
    src = (3, 4, 5, 6, 7, 8, 20, 1, 2, 10, 11, 12, 30, 31, 32, 33)
    dst = (10, 11, 12, 13, 14, 15, 2, 0, 9, 5, 6, 7, 20, 25, 21, 3)  # the last 4 are consecutive in src only
    assert find_in_place_spans(src, dst, geometry, staging_bytes=4 * ROW_BYTES, min_row_bytes=3 * ROW_BYTES) == (
        (0, 4), (4, 6), (9, 12), (12, 16))  # runs of 3+ blocks, cut at 4 blocks a row
    assert find_in_place_spans(src, dst, geometry, staging_bytes=4 * ROW_BYTES, min_row_bytes=7 * ROW_BYTES) == ()
    assert find_in_place_spans(src, dst, geometry, staging_bytes=2 * ROW_BYTES, min_row_bytes=3 * ROW_BYTES) == ()


def test_runs_on_both_sides_win_over_a_longer_run_on_one():
    src = (0, 1, 2, 3, 4, 5)
    dst = (7, 8, 9, 2, 3, 4)  # consecutive on both sides: [0, 3) and [3, 6); on src alone: [0, 6)
    spans = find_in_place_spans(src, dst, tiny_geometry(num_blocks=40), staging_bytes=8 * ROW_BYTES,
                                min_row_bytes=2 * ROW_BYTES)
    assert spans == ((0, 3), (3, 6))


def test_spans_travel_row_by_row_between_staged_groups():
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=7, staging_bytes=2 * BLOCK_BYTES,
                                 in_place_spans=((1, 3), (5, 7)))
    chunks = list(plan.chunks())
    assert [(c.block_start, c.block_stop, c.row_start, c.row_stop) for c in chunks] == [
        (0, 1, 0, 4),
        (1, 3, 0, 1), (1, 3, 1, 2), (1, 3, 2, 3), (1, 3, 3, 4),
        (3, 5, 0, 4),
        (5, 7, 0, 1), (5, 7, 1, 2), (5, 7, 2, 3), (5, 7, 3, 4)]
    assert [c.index for c in chunks] == list(range(10))
    assert sum(plan.chunk_bytes(c) for c in chunks) == plan.num_bytes
    receiver = ChunkPlan.from_header(tiny_geometry(num_blocks=40), 7, plan.blocks_per_chunk, plan.rows_per_chunk,
                                     plan.in_place_spans)
    assert list(receiver.chunks()) == chunks


@pytest.mark.parametrize("spans", [((2, 2),), ((3, 5), (4, 6)), ((4, 6), (0, 2)), ((5, 8),)])
def test_bad_in_place_spans_are_refused_naming_the_field(spans):
    with pytest.raises(InvalidArgument, match="header.in_place_spans"):
        ChunkPlan.from_header(tiny_geometry(), 7, 1, 4, spans)


def test_a_span_row_counts_toward_the_biggest_chunk():
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=12, staging_bytes=BLOCK_BYTES, in_place_spans=((0, 12),))
    assert plan.max_chunk_bytes == 12 * ROW_BYTES  # a receiver with smaller buffers refuses it
