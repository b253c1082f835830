"""How a block transfer is cut into chunks that fit one staging buffer.

A KV tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` is viewed as rows:
`[layers * 2, blocks, row_elems]`, a row being one layer's K or V of one block
(`row_elems = block_size * kv_heads * head_dim`). A chunk is a group of the transfer's
blocks and a group of rows; staged, it is a C-contiguous `[rows, blocks, row_elems]`
array. Chunks go block group by block group, row groups in order inside each, so the
rows of any one block always arrive in ascending order (checksums chain over them).

Blocks that fit the staging buffer travel whole (`rows_per_chunk` = all rows); a block
bigger than the buffer is split by rows (`blocks_per_chunk` = 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.instance.engine.kv_cache import KvGeometry


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    block_start: int  # index into the transfer's block id lists, not a block id
    block_stop: int
    row_start: int
    row_stop: int

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

    def __post_init__(self) -> None:
        if self.blocks_per_chunk > 1 and self.rows_per_chunk < self.num_rows:
            raise InvalidArgument("chunk plan: split rows only with one block per chunk")

    @classmethod
    def for_staging(cls, geometry: KvGeometry, num_blocks: int, staging_bytes: int) -> ChunkPlan:
        """The biggest chunks that fit `staging_bytes`."""
        num_rows, row_elems, itemsize = layout(geometry)
        row_bytes = row_elems * itemsize
        if staging_bytes < row_bytes:
            raise InvalidArgument(f"staging buffer of {staging_bytes} bytes is smaller than one block row "
                                  f"({row_bytes} bytes); raise --staging-kib")
        block_bytes = row_bytes * num_rows
        if staging_bytes >= block_bytes:
            return cls(num_blocks, num_rows, row_elems, itemsize, min(num_blocks, staging_bytes // block_bytes), num_rows)
        return cls(num_blocks, num_rows, row_elems, itemsize, 1, staging_bytes // row_bytes)

    @classmethod
    def from_header(cls, geometry: KvGeometry, num_blocks: int, blocks_per_chunk: int, rows_per_chunk: int) -> ChunkPlan:
        num_rows, row_elems, itemsize = layout(geometry)
        return cls(num_blocks, num_rows, row_elems, itemsize, min(blocks_per_chunk, num_blocks),
                   min(rows_per_chunk, num_rows))

    @property
    def max_chunk_bytes(self) -> int:
        return self.blocks_per_chunk * self.rows_per_chunk * self.row_elems * self.itemsize

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.num_rows * self.row_elems * self.itemsize

    def chunk_bytes(self, chunk: Chunk) -> int:
        return chunk.num_blocks * chunk.num_rows * self.row_elems * self.itemsize

    def chunks(self) -> Iterator[Chunk]:
        index = 0
        for block_start in range(0, self.num_blocks, self.blocks_per_chunk):
            block_stop = min(block_start + self.blocks_per_chunk, self.num_blocks)
            for row_start in range(0, self.num_rows, self.rows_per_chunk):
                yield Chunk(index, block_start, block_stop, row_start, min(row_start + self.rows_per_chunk, self.num_rows))
                index += 1


def layout(geometry: KvGeometry) -> tuple[int, int, int]:
    """(rows per block, elements per row, bytes per element) of a KV geometry."""
    itemsize = torch.empty((), dtype=geometry.dtype).element_size()
    return geometry.num_layers * 2, geometry.block_size * geometry.num_kv_heads * geometry.head_dim, itemsize


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
