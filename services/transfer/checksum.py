"""Per-block crc32, computed at the source and checked on arrival.

A block's checksum is zlib.crc32 chained over its rows in ascending order (row = one
layer's K or V), so a receiver can fold in rows as chunks arrive and compare when a
block's last row is in. A mismatch raises Aborted: the caller must redo the transfer
(the destination blocks hold garbage, and nothing reports success).
"""

from __future__ import annotations

import zlib

import torch

from services.common.errors import Aborted
from services.transfer.block_copy import as_bytes
from services.transfer.chunk_plan import Chunk, ChunkPlan


# Bytes of a GPU cache's blocks copied to the host at a time for their crcs: a GPU's memory is mostly its
# KV cache, so a copy of every block at once (a long migration's, or a destination's cached prefix) could
# run it out of memory, and the caching allocator would keep that much reserved after.
GATHER_BYTES = 64 << 20


def block_checksums(rows: torch.Tensor, block_ids: tuple[int, ...]) -> tuple[int, ...]:
    """crc32 of each block of a `[rows, blocks, row_elems]` tensor, in `block_ids` order (blocks on a
    GPU are copied to the host first, `gathered_checksums`)."""
    if rows.device.type != "cpu":
        return gathered_checksums(rows, block_ids, GATHER_BYTES)
    data = as_bytes(rows)
    return tuple(_fold(data[:, block_id], 0) for block_id in block_ids)


def gathered_checksums(rows: torch.Tensor, block_ids: tuple[int, ...], max_bytes: int) -> tuple[int, ...]:
    """`block_checksums` of blocks gathered on their device and copied to the host at most `max_bytes`
    (and at least one block) at a time."""
    block_bytes = rows.shape[0] * rows[0, 0].numel() * rows.element_size()
    per_copy = max(1, max_bytes // block_bytes)
    checksums: list[int] = []
    for start in range(0, len(block_ids), per_copy):
        ids = torch.tensor(block_ids[start:start + per_copy], dtype=torch.int64, device=rows.device)
        data = as_bytes(rows.index_select(1, ids).cpu())
        checksums += (_fold(data[:, i], 0) for i in range(len(ids)))
    return tuple(checksums)


class ChecksumVerifier:
    """Folds staged chunks into running crcs; raises Aborted when a finished block mismatches."""

    def __init__(self, plan: ChunkPlan, expected: tuple[int, ...]) -> None:
        self._plan = plan
        self._expected = expected
        self._running = [0] * len(expected)  # crc of the rows of each block received so far

    @property
    def is_enabled(self) -> bool:
        return bool(self._expected)

    def update(self, chunk: Chunk, staged: torch.Tensor) -> None:
        if not self._expected:
            return
        data = as_bytes(staged.cpu())
        for offset in range(chunk.num_blocks):
            index = chunk.block_start + offset
            self._running[index] = _fold(data[:, offset], self._running[index])
            if chunk.row_stop == self._plan.num_rows and self._running[index] != self._expected[index]:
                raise Aborted(f"checksum mismatch on block {index} of the transfer (crc32 "
                              f"{self._running[index]:08x}, sender said {self._expected[index]:08x}); "
                              "the blocks were corrupted in transit: redo the transfer")


def _fold(block_rows, crc: int) -> int:
    for row in block_rows:  # each row is contiguous; rows of one block are not
        crc = zlib.crc32(row, crc)
    return crc
