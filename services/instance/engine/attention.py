"""Paged attention in plain PyTorch: the per-step plan and the per-layer kernel.

Design: everything that depends only on the batch (which tokens belong to which
sequence, which cache blocks each sequence reads, the masks) is computed once per
forward in `AttentionPlan.build` and shared by every layer. A layer then does a
few big ops: write its new K/V into their slots in one copy, gather whole blocks
of each sequence into a padded `[seqs, blocks * block_size, kv_heads, head_dim]`
tensor, run `scaled_dot_product_attention` on it, and put the outputs back in
packed token order.

Sequences are split into groups, so a long prefill does not make every decode
sequence pay for its padding: decode sequences (1 new token; the query heads are
folded onto their KV head, so GQA needs no copy) and prefill sequences (queries
padded to the longest one, GQA through `enable_gqa`; a one-token prompt chunk,
such as a prompt's last token after its cached blocks, is a prefill too: it gets the bits
it has within a longer chunk). Decode attention is memory
bound, so its sequences go in chunks whose gathered K/V fit in the CPU cache: the
copy is read back from cache, not from memory. The mask is by position: the query
at position p sees cached token j iff j <= p, which is causal within the new
tokens, sees everything cached before them (continued/chunked prefill), and hides
the stale tail of each sequence's last block and the padding blocks.

Batch invariance (CPU): a decode sequence's attention gives the same bits whatever else
is in the batch and wherever its blocks lie, so a request decodes the same tokens alone,
in a busy batch, and after a migration. SDPA's result changes in the last bits with the
padded key length (not with the batch size or the sequence's place in it), so decode
sequences are padded to a length of their own (`padded_blocks`) and grouped by it, never
to the longest in the step, and each prefill sequence attends in a group of its own. On
a GPU, where the products are not batch-invariant anyway, they are padded together.

A layer with a sliding window of W tokens gets a plan of its own (`AttentionPlan.build(...,
window=W)`): its masks also hide the keys W or more positions back, and its long decode
sequences are gathered rather than read in place. Gemma 2 caps the attention scores (`softcap`: cap * tanh(scores / cap)) before the softmax,
which SDPA cannot do; its layers take an explicit matmul-softmax-matmul path instead.

Plans are built on the host from the scheduler's host tensors; on a GPU, `plan.to(device)`
moves the few index and mask tensors the layers read, once per forward.

A long decode sequence (1024+ keys) skips the gather: its keys and values are read where
they lie, in segments of 512 keys, one matmul each, so a decode step over a long context
reads its cache once instead of copying it first (the block manager hands out the lowest
free ids, so a sequence's blocks are mostly consecutive). The segments are fixed by
position, not by where the blocks lie: a segment whose blocks are not consecutive is
gathered into a copy of the same shape, so the bits do not depend on the layout. Only in
a float32 cache: in a lower precision the gathered path's float32 accumulation is what
keeps a sequence's tokens close to exact.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from services.instance.engine.forward_batch import ForwardBatch

DECODE_CHUNK_BYTES = 1 << 20  # gathered K+V per decode chunk; about one core's L2 cache
IN_PLACE_MIN_KEYS = 1024  # decode sequences with at least this much context are read in place ...
SEGMENT_KEYS = 512  # ... in segments of this many keys (rounded to whole blocks): one matmul each
FUSED_MAX_KV_HEADS = 4  # in-place reads with at most this many KV heads do all heads in one matmul


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    num_blocks: int  # blocks in the cache
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block's K (or V) in one layer
    reads_in_place: bool = True  # float32 only: see `_in_place_group`
    # Each decode sequence padded to a length of its own (batch invariance; `padded_blocks`). Only on
    # the CPU: on a GPU the products are not batch-invariant anyway, and each group costs launches.
    pads_per_sequence: bool = True

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "CacheGeometry":
        """From a cache `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(num_blocks, block_size, block_size * num_kv_heads * head_dim * kv_cache.element_size(),
                   reads_in_place=kv_cache.dtype == torch.float32, pads_per_sequence=kv_cache.device.type == "cpu")


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    num_keys: int  # keys gathered per sequence: its longest context, rounded up to whole blocks
    chunks: tuple[slice, ...]  # sequences attended together, in order
    gather_indices: tuple[torch.Tensor, ...]  # per chunk: rows of a layer's cache as [2 * blocks, -1], K then V
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, num_keys] bool, True = visible; None: all visible/causal
    is_causal: bool  # every sequence starts at position 0, so query row i sees keys 0..i
    token_index: torch.Tensor | None  # [num_seqs, max_query_len] packed token of each query row; None: all, in order
    is_valid: torch.Tensor | None  # [num_seqs * max_query_len] False for padding rows; None: no padding
    out_index: torch.Tensor | None  # [num_valid] packed token of each valid row; None: all, in order

    def to(self, device: torch.device) -> "AttentionGroup":
        return replace(self, gather_indices=tuple(index.to(device) for index in self.gather_indices),
                       mask=_to(self.mask, device), token_index=_to(self.token_index, device),
                       is_valid=_to(self.is_valid, device), out_index=_to(self.out_index, device))


@dataclass(frozen=True, slots=True)
class KeySegment:
    """Keys [k, k + num_keys) of a sequence read in place: consecutive cache slots from
    `first_slot`, or (its blocks not consecutive) gathered from `slots`."""

    first_slot: int
    num_keys: int
    slots: torch.Tensor | None = None  # [num_keys] flat slot of each key, where they are not consecutive

    def to(self, device: torch.device) -> "KeySegment":
        return self if self.slots is None else replace(self, slots=self.slots.to(device))


@dataclass(frozen=True, slots=True)
class InPlaceSequence:
    token: int  # packed index of its one new token
    segments: tuple[KeySegment, ...]  # its context in SEGMENT_KEYS pieces, in order


@dataclass(frozen=True, slots=True)
class InPlaceGroup:
    sequences: tuple[InPlaceSequence, ...]
    out_index: torch.Tensor  # [num_seqs] packed token of each sequence

    def to(self, device: torch.device) -> "InPlaceGroup":
        sequences = tuple(replace(seq, segments=tuple(segment.to(device) for segment in seq.segments))
                          for seq in self.sequences)
        return replace(self, sequences=sequences, out_index=self.out_index.to(device))


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    decode: tuple[AttentionGroup, ...]  # sequences with exactly one new token, gathered, by padded length
    prefill: tuple[AttentionGroup, ...]  # sequences with more than one new token: one group each on the CPU
    in_place: InPlaceGroup | None = None  # long decode sequences, read in place

    @classmethod
    def build(cls, batch: ForwardBatch, geometry: CacheGeometry, window: int | None = None) -> "AttentionPlan":
        """The plan of one forward; `window`: a query at position p sees only keys p - window < j <= p."""
        query_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        starts = torch.cumsum(query_lens, 0) - query_lens
        is_decode = torch.tensor(batch.is_decode(), dtype=torch.bool)  # a one-token prompt chunk is a prefill
        is_prefill = ~is_decode
        in_place, in_place_seqs = _in_place_group(batch, is_decode, starts, geometry, window)
        is_decode[in_place_seqs] = False
        if batch.is_decode_only and in_place is None:
            return cls(batch.slot_mapping, _decode_groups(batch, None, starts, geometry, window), ())
        decode, prefill = (), ()
        if bool(is_decode.any()):
            decode = _decode_groups(batch, torch.nonzero(is_decode).flatten(), starts, geometry, window)
        prefill_seqs = torch.nonzero(is_prefill).flatten()
        if len(prefill_seqs):
            # Batch invariance: a prompt's queries and keys are not padded to another's in the same step
            members = prefill_seqs.split(1) if geometry.pads_per_sequence else (prefill_seqs,)
            prefill = tuple(_prefill_group(batch, seqs, query_lens, starts, geometry, window) for seqs in members)
        return cls(batch.slot_mapping, decode, prefill, in_place)

    def to(self, device: torch.device) -> "AttentionPlan":
        """The plan with every tensor a layer reads on `device` (plans are built from host tensors)."""
        if device.type == "cpu":
            return self
        return AttentionPlan(self.slot_mapping.to(device), tuple(group.to(device) for group in self.decode),
                             tuple(group.to(device) for group in self.prefill),
                             None if self.in_place is None else self.in_place.to(device))


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _gather_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, geometry: CacheGeometry, max_chunk_bytes: int | None,
    num_blocks: int | None = None,
) -> tuple[int, tuple[slice, ...], tuple[torch.Tensor, ...]]:
    """(num_keys, chunks, gather_indices) for sequences with these block tables and contexts, each
    gathered as `num_blocks` blocks (default: as many as the longest context needs; more are padded
    with block 0, whose keys the mask hides); max_chunk_bytes None: all sequences in one chunk."""
    needed = (int(context_lens.max()) + geometry.block_size - 1) // geometry.block_size
    num_blocks = needed if num_blocks is None else num_blocks
    if block_tables.shape[1] < needed or num_blocks < needed:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns and {num_blocks} are gathered, "
                         f"the longest context needs {needed}")
    block_tables = F.pad(block_tables[:, :num_blocks], (0, max(0, num_blocks - block_tables.shape[1])))
    num_seqs = block_tables.shape[0]
    chunk_seqs = num_seqs
    if max_chunk_bytes is not None:
        chunk_seqs = max(1, max_chunk_bytes // (2 * num_blocks * geometry.block_bytes))
    chunks = tuple(slice(i, min(i + chunk_seqs, num_seqs)) for i in range(0, num_seqs, chunk_seqs))
    flats = [block_tables[chunk].flatten() for chunk in chunks]
    indices = tuple(torch.cat((flat, flat + geometry.num_blocks)) for flat in flats)
    return num_blocks * geometry.block_size, chunks, indices


def padded_blocks(num_blocks: int) -> int:
    """The blocks a decode sequence of `num_blocks` is gathered as: itself up to 4, then rounded up to
    a quarter of its power of two (at most 25% more). It depends on the sequence alone, never on
    the others in the batch: SDPA's result changes, in the last bits, with the padded length, so
    a sequence padded to another's length would decode differently in a busy batch, or after a
    migration, than alone."""
    if num_blocks <= 4:
        return num_blocks
    step = 1 << (num_blocks.bit_length() - 3)
    return -(-num_blocks // step) * step


def _decode_groups(
    batch: ForwardBatch, seqs: torch.Tensor | None, starts: torch.Tensor, geometry: CacheGeometry, window: int | None
) -> tuple[AttentionGroup, ...]:
    """The decode sequences `seqs` (None: every sequence), grouped by padded length (`padded_blocks`)."""
    context_lens = batch.context_lens if seqs is None else batch.context_lens[seqs]
    block_tables = batch.block_tables if seqs is None else batch.block_tables[seqs]
    is_windowed = window is not None and bool((context_lens > window).any())
    if is_windowed:
        block_tables, context_lens = _window_blocks(block_tables, context_lens, window, geometry.block_size)
    cut_to = window if is_windowed else None
    needed = [-(-n // geometry.block_size) for n in context_lens.tolist()]
    sizes = [padded_blocks(n) for n in needed] if geometry.pads_per_sequence else [max(needed)] * len(needed)
    if len(set(sizes)) == 1 and seqs is None:  # the packed tokens in order: no index needed
        return (_decode_group(block_tables, context_lens, sizes[0], None, geometry, cut_to),)
    token_starts = starts if seqs is None else starts[seqs]
    groups = []
    for size in sorted(set(sizes)):
        members = torch.tensor([i for i, each in enumerate(sizes) if each == size], dtype=torch.int64)
        groups.append(_decode_group(block_tables[members], context_lens[members], size, token_starts[members],
                                    geometry, cut_to))
    return tuple(groups)


def _decode_group(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, token_starts: torch.Tensor | None,
    geometry: CacheGeometry, window: int | None,
) -> AttentionGroup:
    """Decode sequences gathered as `num_blocks` blocks each; `window`: their contexts were cut to it."""
    num_keys, chunks, indices = _gather_plan(block_tables, context_lens, geometry, DECODE_CHUNK_BYTES, num_blocks)
    mask = None
    if window is not None or bool((context_lens != num_keys).any()):
        keys = torch.arange(num_keys)
        mask = keys < context_lens[:, None]
        if window is not None:
            mask &= keys >= context_lens[:, None] - window  # the one query sits at position context_len - 1
        mask = mask.view(-1, 1, 1, num_keys)
    token_index = None if token_starts is None else token_starts.view(-1, 1)  # a decode sequence's only token
    out_index = None if token_index is None else token_index.flatten()
    return AttentionGroup(num_keys, chunks, indices, mask, False, token_index, None, out_index)


def _window_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode sequence's block table from the block holding its window's first key on, and
    its context counted from there: a long context with a short window gathers the window only."""
    first = (context_lens - window).clamp(min=0) // block_size  # [seqs] first block with a key in the window
    shifted = context_lens - first * block_size
    num_blocks = (int(shifted.max()) + block_size - 1) // block_size
    columns = (first[:, None] + torch.arange(num_blocks)).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, columns), shifted


def _in_place_group(batch: ForwardBatch, is_decode: torch.Tensor, starts: torch.Tensor, geometry: CacheGeometry,
                    window: int | None) -> tuple[InPlaceGroup | None, list[int]]:
    """The decode sequences to read in place (long context, all of it inside the window), and
    their indexes. Which ones they are depends on their contexts alone, never on where their
    blocks lie, and so do their segments (`_segments`): a migrated request, whose blocks lie
    elsewhere, attends with the same bits.

    Only a float32 cache is read in place: `_attend_segments` computes in the cache's dtype,
    which in bfloat16 or float16 rounds every score (~9x the error of SDPA, which accumulates
    in float32)."""
    if not geometry.reads_in_place:
        return None, []
    is_candidate = is_decode & (batch.context_lens >= IN_PLACE_MIN_KEYS)
    if window is not None:
        is_candidate &= batch.context_lens <= window
    seqs = torch.nonzero(is_candidate).flatten().tolist()
    if not seqs:
        return None, []
    sequences = tuple(InPlaceSequence(int(starts[seq]), _segments(batch.block_tables[seq],
                                                                  int(batch.context_lens[seq]), geometry.block_size))
                      for seq in seqs)
    return InPlaceGroup(sequences, torch.tensor([s.token for s in sequences], dtype=torch.int64)), seqs


def _segments(block_table: torch.Tensor, context_len: int, block_size: int) -> tuple[KeySegment, ...]:
    """The first `context_len` keys in pieces of SEGMENT_KEYS (whole blocks), each read where it
    lies when its blocks are consecutive, else gathered."""
    blocks_per_segment = max(1, SEGMENT_KEYS // block_size)
    segments = []
    for first_key in range(0, context_len, blocks_per_segment * block_size):
        num_keys = min(blocks_per_segment * block_size, context_len - first_key)
        blocks = block_table[first_key // block_size:(first_key + num_keys + block_size - 1) // block_size]
        first_slot = int(blocks[0]) * block_size
        if bool((blocks[1:] - blocks[:-1] == 1).all()):
            segments.append(KeySegment(first_slot, num_keys))
        else:
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_keys]
            segments.append(KeySegment(first_slot, num_keys, slots))
    return tuple(segments)


def _prefill_group(
    batch: ForwardBatch, seqs: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor, geometry: CacheGeometry,
    window: int | None,
) -> AttentionGroup:
    lens, context_lens = query_lens[seqs], batch.context_lens[seqs]
    num_keys, chunks, indices = _gather_plan(batch.block_tables[seqs], context_lens, geometry, None)
    offsets = torch.arange(int(lens.max()))
    is_valid = offsets < lens[:, None]
    token_index = torch.where(is_valid, starts[seqs][:, None] + offsets, 0)
    is_windowed = window is not None and int(context_lens.max()) > window
    is_causal = bool((context_lens == lens).all()) and not is_windowed  # nothing cached before the new tokens
    mask = None
    if not is_causal:
        positions = batch.positions[token_index]  # padding rows take token 0's position: they see key 0 at least
        keys = torch.arange(num_keys)
        mask = keys <= positions[:, :, None]
        if is_windowed:
            mask &= keys > positions[:, :, None] - window
        mask = mask.unsqueeze(1)
    is_valid = is_valid.flatten()
    out_index = token_index.flatten()[is_valid]
    is_valid = None if bool(is_valid.all()) else is_valid
    return AttentionGroup(num_keys, chunks, indices, mask, is_causal, token_index, is_valid, out_index)


def write_kv(kv_layer: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V (`kv`: [num_tokens, 2 * kv_heads, head_dim], K heads first)
    in their slots of one layer's cache, in one copy."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    src = kv.view(-1, 2, num_kv_heads, head_dim).transpose(0, 1)
    kv_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim).index_copy_(1, slot_mapping, src)


def attend(q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Attention of the new queries ([num_tokens, heads, head_dim]) over each sequence's cached
    context (already including the new tokens); returns [num_tokens, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    if not plan.prefill and plan.in_place is None and len(plan.decode) == 1 and plan.decode[0].out_index is None:
        return _attend_decode(q, kv_layer, plan.decode[0], scale, softcap).view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in plan.decode:
        out[group.out_index] = _attend_decode(q, kv_layer, group, scale, softcap).flatten(1)
    if plan.in_place is not None:
        out[plan.in_place.out_index] = _attend_in_place(q, kv_layer, plan.in_place, scale, softcap)
    for group in plan.prefill:
        out[group.out_index] = _attend_prefill(q, kv_layer, group, scale, softcap)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention (GQA when q has more heads than k), or with the scores capped."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = _capped(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _gather(kv_layer: torch.Tensor, index: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the sequences `index` selects, each [num_seqs, kv_heads, num_keys, head_dim]."""
    _, num_cache_blocks, _, num_kv_heads, head_dim = kv_layer.shape
    kv = kv_layer.view(2 * num_cache_blocks, -1).index_select(0, index)
    kv = kv.view(2, -1, num_keys, num_kv_heads, head_dim)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _attend_decode(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float,
                   softcap: float | None) -> torch.Tensor:
    """One query per sequence; the query heads of a KV head become its query rows (GQA without copies)."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    if group.token_index is not None:
        q = q[group.token_index.flatten()]
    q = q.view(q.shape[0], num_kv_heads, -1, head_dim)
    with _one_thread(q.device):  # SDPA, for its bits; the gathers, small copies, faster on one thread too
        if len(group.chunks) == 1:
            return _sdpa_decode(q, kv_layer, group, 0, scale, softcap).view(q.shape[0], -1, head_dim)
        out = q.new_empty(q.shape)
        for i, chunk in enumerate(group.chunks):
            out[chunk] = _sdpa_decode(q[chunk], kv_layer, group, i, scale, softcap)
        return out.view(q.shape[0], -1, head_dim)


def _sdpa_decode(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, i: int, scale: float,
                 softcap: float | None) -> torch.Tensor:
    k, v = _gather(kv_layer, group.gather_indices[i], group.num_keys)
    mask = None if group.mask is None else group.mask[group.chunks[i]]
    return _sdpa(q, k, v, mask, scale, softcap)


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """Torch ops inside run on one CPU thread. SDPA's CPU kernel gives a (sequence, KV head) pair other bits on
    another OpenMP thread than on the first (each thread has its own scratch), and which thread takes a pair
    depends on the pairs before it in the call, so on two threads a decode sequence got other bits in a batch
    than alone. On one thread every pair is the first thread's, as alone."""
    num_threads = torch.get_num_threads()
    if device.type != "cpu" or num_threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _attend_in_place(q: torch.Tensor, kv_layer: torch.Tensor, group: InPlaceGroup, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """[num_seqs, heads * head_dim]: each sequence's one query over its segments of cache slots."""
    _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    slots = kv_layer.view(2, num_cache_blocks * block_size, num_kv_heads, head_dim)
    out = q.new_empty(len(group.sequences), q.shape[1] * head_dim)
    for i, seq in enumerate(group.sequences):
        query = q[seq.token].view(num_kv_heads, -1, head_dim)  # a KV head's query heads as its rows
        out[i] = _attend_segments(query, slots, seq.segments, scale, softcap).flatten()
    return out


def _attend_segments(q: torch.Tensor, slots: torch.Tensor, segments: tuple[KeySegment, ...], scale: float,
                     softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of q [kv_heads, group, head_dim] over the keys of `segments` in `slots`
    [2, num_slots, kv_heads, head_dim]: scores segment by segment, one softmax over all of them,
    then the values segment by segment, summed in order. A gathered segment has the shape and
    strides of one read in place, so both give the same bits.

    With few KV heads, all heads go in one matmul against the cache rows as they lie
    ([slots, kv_heads * head_dim], each read once) with a block-diagonal query: kv_heads times
    the multiplies, which are cheap next to reading the cache. With many, one matmul per
    head over its strided slice of the rows."""
    num_kv_heads, group, head_dim = q.shape
    is_fused = num_kv_heads <= FUSED_MAX_KV_HEADS
    if is_fused:
        q = _block_diagonal(q)  # [kv_heads * group, kv_heads * head_dim]
    scores = [torch.matmul(q, _segment_keys(slots[0], segment, is_fused)) for segment in segments]
    probs = torch.softmax(_capped(torch.cat(scores, dim=-1).mul_(scale), softcap), dim=-1,
                          dtype=torch.float32).to(q.dtype)
    out, offset = None, 0
    for segment in segments:
        part = torch.matmul(probs[..., offset:offset + segment.num_keys], _segment_values(slots[1], segment, is_fused))
        out = part if out is None else out.add_(part)
        offset += segment.num_keys
    if is_fused:  # [kv_heads * group, kv_heads * head_dim]: head h's output is diagonal block h
        out = torch.diagonal(out.view(num_kv_heads, group, num_kv_heads, head_dim), dim1=0, dim2=2).permute(2, 0, 1)
    return out


def _segment_rows(rows: torch.Tensor, segment: KeySegment) -> torch.Tensor:
    """[num_keys, kv_heads, head_dim] of `rows` [num_slots, kv_heads, head_dim]: a view, or a gathered copy."""
    if segment.slots is None:
        return rows[segment.first_slot:segment.first_slot + segment.num_keys]
    return rows.index_select(0, segment.slots)


def _segment_keys(keys: torch.Tensor, segment: KeySegment, is_fused: bool) -> torch.Tensor:
    rows = _segment_rows(keys, segment)
    return rows.flatten(1).t() if is_fused else rows.permute(1, 2, 0)  # [kv_heads * head_dim | kv_heads, head_dim, n]


def _segment_values(values: torch.Tensor, segment: KeySegment, is_fused: bool) -> torch.Tensor:
    rows = _segment_rows(values, segment)
    return rows.flatten(1) if is_fused else rows.transpose(0, 1)  # [n, kv_heads * head_dim | kv_heads, n, head_dim]


def _block_diagonal(q: torch.Tensor) -> torch.Tensor:
    """[kv_heads, group, head_dim] → [kv_heads * group, kv_heads * head_dim], row (h, g) holding
    q[h, g] in column block h and zeros elsewhere."""
    num_kv_heads, group, head_dim = q.shape
    out = q.new_zeros(num_kv_heads, group, num_kv_heads, head_dim)
    torch.diagonal(out, dim1=0, dim2=2).copy_(q.permute(1, 2, 0))
    return out.view(num_kv_heads * group, num_kv_heads * head_dim)


def _attend_prefill(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float,
                    softcap: float | None) -> torch.Tensor:
    k, v = _gather(kv_layer, group.gather_indices[0], group.num_keys)
    num_seqs, max_query_len = group.token_index.shape
    q = q[group.token_index].transpose(1, 2)  # [num_seqs, heads, max_query_len, head_dim]
    out = _sdpa(q, k, v, group.mask, scale, softcap, is_causal=group.is_causal)
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, -1)
    return out if group.is_valid is None else out[group.is_valid]
