"""How a block transfer is cut into chunks that fit one staging buffer.

A KV tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` is viewed as rows:
`[layers * 2, blocks, row_elems]`, a row being one layer's K or V of one block
(`row_elems = block_size * kv_heads * head_dim`). A chunk is a group of the transfer's
blocks and a group of rows; staged, it is a C-contiguous `[rows, blocks, row_elems]`
array. Chunks go block group by block group, row groups in order inside each, so the
rows of any one block always arrive in ascending order (checksums chain over them).

Blocks that fit the staging buffer travel whole (`rows_per_chunk` = all rows); a block
bigger than the buffer is split by rows (`blocks_per_chunk` = 1).

In-place spans: in a stretch of the transfer's blocks with consecutive ids on one side,
each row is one contiguous piece of that side's KV memory. Such a span travels row by
row (one chunk per row, `[1, blocks, row_elems]`), so on gloo that side sends it
straight from its memory or receives it straight into it, with no gather or scatter;
a side whose ids there are not consecutive stages the rows as usual. Stretches
consecutive on both sides (no copy at all) are taken first. Spans are taken where their
rows are at least `IN_PLACE_MIN_ROW_BYTES` long (`--in-place-min-kib`; for shorter ones,
gloo's cost per message and the staged chunks drained before each span outweigh the
copies saved); the blocks between spans are chunked as above.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


from services.common.errors import InvalidArgument
from services.instance.engine.kv_cache import KvGeometry

# Rows of 256 KiB (a run of 2 blocks of Llama-2-7B) measured slower in place than staged:
# each span drains the staged chunks in flight first. From 512 KiB up in place is faster.
IN_PLACE_MIN_ROW_BYTES = 512 << 10
Span = tuple[int, int]  # [start, stop) of the transfer's block lists


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    block_start: int  # index into the transfer's block id lists, not a block id
    block_stop: int
    row_start: int
    row_stop: int
    in_span: bool = False  # one row of an in-place span

    @property
    def num_blocks(self) -> int:
        return self.block_stop - self.block_start

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    num_blocks: int
    num_rows: int
    row_elems: int
    itemsize: int
    blocks_per_chunk: int
    rows_per_chunk: int
    in_place_spans: tuple[Span, ...] = ()  # ascending, disjoint; each travels row by row

    def __post_init__(self) -> None:
        if self.blocks_per_chunk > 1 and self.rows_per_chunk < self.num_rows:
            raise InvalidArgument("chunk plan: split rows only with one block per chunk")
        position = 0
        for start, stop in self.in_place_spans:
            if not position <= start < stop <= self.num_blocks:
                raise InvalidArgument(f"header.in_place_spans: span [{start}, {stop}) is empty, overlaps another, "
                                      f"is out of order or lies outside the {self.num_blocks} blocks")
            position = stop

    @classmethod
    def for_staging(cls, geometry: KvGeometry, num_blocks: int, staging_bytes: int,
                    in_place_spans: tuple[Span, ...] = ()) -> ChunkPlan:
        """The biggest chunks that fit `staging_bytes` (in-place spans: see `find_in_place_spans`)."""
        num_rows, row_elems, itemsize = layout(geometry)
        row_bytes = row_elems * itemsize
        if staging_bytes < row_bytes:
            raise InvalidArgument(f"staging buffer of {staging_bytes} bytes is smaller than one block row "
                                  f"({row_bytes} bytes); raise --staging-kib")
        block_bytes = row_bytes * num_rows
        if staging_bytes >= block_bytes:
            return cls(num_blocks, num_rows, row_elems, itemsize, min(num_blocks, staging_bytes // block_bytes), num_rows,
                       in_place_spans)
        return cls(num_blocks, num_rows, row_elems, itemsize, 1, staging_bytes // row_bytes, in_place_spans)

    @classmethod
    def from_header(cls, geometry: KvGeometry, num_blocks: int, blocks_per_chunk: int, rows_per_chunk: int,
                    in_place_spans: tuple[Span, ...] = ()) -> ChunkPlan:
        num_rows, row_elems, itemsize = layout(geometry)
        return cls(num_blocks, num_rows, row_elems, itemsize, min(blocks_per_chunk, num_blocks),
                   min(rows_per_chunk, num_rows), in_place_spans)

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.itemsize

    @property
    def max_chunk_bytes(self) -> int:
        staged = self.blocks_per_chunk * self.rows_per_chunk * self.row_bytes
        return max((staged, *((stop - start) * self.row_bytes for start, stop in self.in_place_spans)))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.num_rows * self.row_elems * self.itemsize

    def chunk_bytes(self, chunk: Chunk) -> int:
        return chunk.num_blocks * chunk.num_rows * self.row_elems * self.itemsize

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk in transfer order: the staged blocks before each span, then the span row by row."""
        index, position = 0, 0
        for start, stop in (*self.in_place_spans, (self.num_blocks, self.num_blocks)):
            for block_start in range(position, start, self.blocks_per_chunk):
                block_stop = min(block_start + self.blocks_per_chunk, start)
                for row_start in range(0, self.num_rows, self.rows_per_chunk):
                    yield Chunk(index, block_start, block_stop, row_start,
                                min(row_start + self.rows_per_chunk, self.num_rows))
                    index += 1
            for row in range(self.num_rows if stop > start else 0):
                yield Chunk(index, start, stop, row, row + 1, in_span=True)
                index += 1
            position = stop


def find_in_place_spans(src_ids: Sequence[int], dst_ids: Sequence[int], geometry: KvGeometry, staging_bytes: int,
                        min_row_bytes: int = IN_PLACE_MIN_ROW_BYTES) -> tuple[Span, ...]:
    """The stretches of a transfer consecutive on both sides, or else on one, whose rows are
    at least `min_row_bytes` long, cut so that no row is longer than `staging_bytes` (a
    side that cannot take a row in place stages it)."""
    _num_rows, row_elems, itemsize = layout(geometry)
    row_bytes = row_elems * itemsize
    min_blocks, max_blocks = max(1, -(-min_row_bytes // row_bytes)), staging_bytes // row_bytes
    spans: list[Span] = []
    start = 0
    while start < len(src_ids) and max_blocks >= min_blocks:
        length = _run_length(src_ids, dst_ids, start)
        if length < min_blocks:
            length = max(_run_length(src_ids, src_ids, start), _run_length(dst_ids, dst_ids, start))
        if length < min_blocks:
            start += 1
            continue
        spans += [(first, min(first + max_blocks, start + length)) for first in range(start, start + length, max_blocks)]
        start += length
    return tuple(spans)


def _run_length(ids: Sequence[int], other_ids: Sequence[int], start: int) -> int:
    """How many ids from `start` ascend by one in both `ids` and `other_ids`."""
    stop = start + 1
    while stop < len(ids) and ids[stop] == ids[stop - 1] + 1 and other_ids[stop] == other_ids[stop - 1] + 1:
        stop += 1
    return stop - start


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> Iterator[Span]:
    """[start, stop) of each stretch of the transfer whose ids ascend by one on both sides."""
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            yield start, i
            start = i


def layout(geometry: KvGeometry) -> tuple[int, int, int]:
    """(rows per block, elements per row, bytes per element) of a KV geometry."""
    return geometry.num_layers * 2, geometry.block_size * geometry.num_kv_heads * geometry.head_dim, geometry.dtype.itemsize


def check_compatible(src: KvGeometry, dst: KvGeometry) -> None:
    """Blocks move between caches whose geometries differ at most in num_blocks."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
        if getattr(src, name) != getattr(dst, name):
            raise InvalidArgument(f"kv geometry mismatch: source {name}={getattr(src, name)}, destination "
                                  f"{name}={getattr(dst, name)}; blocks move only between instances of one model")


def check_block_ids(block_ids: tuple[int, ...], num_blocks: int, what: str, is_unique: bool) -> None:
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise InvalidArgument(f"{what}: block id {block_id} is outside 0..{num_blocks - 1}")
    if is_unique and len(set(block_ids)) != len(block_ids):
        raise InvalidArgument(f"{what}: duplicate block ids; each destination block may be written once")
