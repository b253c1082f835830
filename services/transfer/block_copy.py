"""Gather, scatter and direct copies of KV blocks, on `[rows, blocks, row_elems]` views.

Gather is `torch.index_select(..., out=staging_view)` into a preallocated buffer (for the
grpc backend: contiguous pieces of the KV memory joined straight into the message, `chunk_parts`).
Scatter on CPU copies runs of consecutive destination ids with slice `copy_`s (torch
shares each among its intra-op threads: 15 GB/s for an 8 MiB block with two threads
against 9.7 GB/s for one, and `index_copy_` measured ~2.7 GB/s); on CUDA it is
`index_copy_`. Neither allocates block-sized memory on the host. A cache on a GPU (mapped
through CUDA IPC) is gathered and scattered on its device through a chunk-sized temporary
from torch's caching allocator, and every copy into it is waited for before it returns.
Direct copies (the SHM backend) go source rows to destination rows by the same runs, with
no staging.
Torch and numpy copies release the GIL, so these run on worker threads while the event loop serves.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from services.transfer.chunk_plan import Chunk, ChunkPlan, paired_runs

# In-place rows per thread hop (`segments`): making their chunks holds the event loop ~0.3 ms and their
# views take the thread ~1.5 ms (512-byte rows, measured); each hop first drains the rows in flight.
IN_PLACE_BATCH_ROWS = 256


def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """`[layers, 2, blocks, ...]` → `[layers * 2, blocks, row_elems]` (a view)."""
    return kv.view(kv.shape[0] * kv.shape[1], kv.shape[2], -1)


def staged_view(buffer: torch.Tensor, plan: ChunkPlan, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a uint8 staging `buffer` as the chunk's `[rows, blocks, row_elems]` array."""
    num_bytes = plan.chunk_bytes(chunk)
    return buffer[:num_bytes].view(dtype).view(chunk.num_rows, chunk.num_blocks, plan.row_elems)


def gather_chunk(rows: torch.Tensor, block_ids: torch.Tensor, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
    """Copy the chunk's blocks and rows of `rows` into `out` (a `staged_view`); `block_ids` lie on
    `rows`' device. A GPU cache gathers on its device, then copies into host `out` (which waits for it)."""
    ids = block_ids[chunk.block_start:chunk.block_stop]
    source = rows[chunk.row_start:chunk.row_stop]
    if source.device == out.device:
        return torch.index_select(source, 1, ids, out=out)
    return out.copy_(torch.index_select(source, 1, ids))


def chunk_parts(rows: np.ndarray, block_ids: tuple[int, ...], chunk: Chunk) -> list[np.ndarray]:
    """The chunk's bytes as contiguous pieces of `rows` (`as_bytes` of the KV), in staged order.

    Joining them is the gather: `b"".join(parts)` equals the chunk's staged bytes, with
    one copy and no staging buffer (the grpc sender needs a fresh `bytes` per message anyway)."""
    ids = block_ids[chunk.block_start:chunk.block_stop]
    runs = list(block_runs(ids))
    return [rows[row, first_id:first_id + length] for row in range(chunk.row_start, chunk.row_stop)
            for _offset, first_id, length in runs]


def scatter_chunk(rows: torch.Tensor, block_ids: tuple[int, ...], chunk: Chunk, staged: torch.Tensor) -> None:
    """Copy a staged chunk into the destination block ids of `rows`."""
    ids = block_ids[chunk.block_start:chunk.block_stop]
    target = rows[chunk.row_start:chunk.row_stop]
    if rows.device.type != "cpu":
        target.index_copy_(1, torch.tensor(ids, device=rows.device), staged.to(rows.device))
        synchronize(rows)
        return
    for offset, first_id, length in block_runs(ids):
        target[:, first_id:first_id + length].copy_(staged[:, offset:offset + length])


def copy_blocks(src_rows: torch.Tensor, src_ids: tuple[int, ...], dst_rows: torch.Tensor,
                dst_ids: tuple[int, ...], row_start: int = 0, row_stop: int | None = None) -> None:
    """Direct copy `src_rows[:, src_ids[i]]` → `dst_rows[:, dst_ids[i]]`, no staging (one host)."""
    src, dst = src_rows[row_start:row_stop], dst_rows[row_start:row_stop]
    for start, stop in paired_runs(src_ids, dst_ids):
        src_first, dst_first, length = src_ids[start], dst_ids[start], stop - start
        dst[:, dst_first:dst_first + length].copy_(src[:, src_first:src_first + length])
    synchronize(dst_rows)


def synchronize(rows: torch.Tensor) -> None:
    """Wait until this process's copies into a GPU cache are done: the instance that owns it reads
    the blocks from its own process as soon as the transfer reports success."""
    if rows.device.type == "cuda":
        torch.cuda.synchronize(rows.device)


def segments(plan: ChunkPlan, rows: torch.Tensor, block_ids: tuple[int, ...], is_in_place: bool
             ) -> Iterator[tuple[Iterable[Chunk], bool]]:
    """The plan's chunks in stretches, in order, each with whether it moves in place: the rows of
    in-place spans that lie contiguously in `rows` here (and `is_in_place`) in lists of at most
    IN_PLACE_BATCH_ROWS, whose views the thread that moves them makes (`in_place_views`); the
    rest, staged through the buffers, as an iterator that makes each chunk as it is taken (the
    caller takes all of it before the next stretch). So no step of the event loop makes more than
    one batch of chunks: a transfer of 2 KiB rows has 64k of them (~10 us each, with their views)."""
    lies_in_place = is_in_place and rows.device.type == "cpu" and rows.is_contiguous()

    @functools.cache
    def ascends(start: int, stop: int) -> bool:  # a span's rows lie contiguously here (once per span)
        return is_consecutive(block_ids[start:stop])

    def moves_in_place(chunk: Chunk) -> bool:
        return lies_in_place and chunk.in_span and ascends(chunk.block_start, chunk.block_stop)
    for in_place, group in itertools.groupby(plan.chunks(), key=moves_in_place):
        if not in_place:
            yield group, False
            continue
        while batch := list(itertools.islice(group, IN_PLACE_BATCH_ROWS)):
            yield batch, True


def in_place_views(rows: torch.Tensor, block_ids: tuple[int, ...], chunks: list[Chunk]) -> list[torch.Tensor]:
    """Each chunk of an in-place batch (`segments`) where it lies in `rows`, as flat bytes. On the
    thread that moves them: a view takes ~10 us."""
    views = [in_place_view(rows, block_ids, chunk) for chunk in chunks]
    if any(view is None for view in views):
        raise ValueError("in_place_views: a chunk does not lie in place; segments() stages those")
    return [view.view(torch.uint8).view(-1) for view in views]


def in_place_view(rows: torch.Tensor, block_ids: tuple[int, ...], chunk: Chunk) -> torch.Tensor | None:
    """The chunk where it lies in CPU `rows` if that is one contiguous piece (one row of
    consecutive ids), else None: then it goes through a staging buffer."""
    ids = block_ids[chunk.block_start:chunk.block_stop]
    if rows.device.type != "cpu" or not is_consecutive(ids):
        return None
    view = rows[chunk.row_start:chunk.row_stop, ids[0]:ids[0] + len(ids)]
    return view if view.is_contiguous() else None


def as_bytes(rows: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU `[rows, blocks, row_elems]` tensor (any dtype, bf16 too)."""
    return rows.view(torch.uint8).numpy()


def is_consecutive(ids: Sequence[int]) -> bool:
    """Whether the (non-empty) ids ascend by one: their blocks' rows then lie contiguously in the KV memory."""
    return tuple(ids) == tuple(range(ids[0], ids[0] + len(ids)))


def block_runs(ids: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """(offset in ids, first id, length) of each run of consecutive ascending ids."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, ids[start], i - start
            start = i
