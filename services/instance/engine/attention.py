"""Paged attention in plain PyTorch: the per-step plan and the per-layer kernel.

Design: everything that depends only on the batch (which tokens belong to which
sequence, which cache blocks each sequence reads, the masks) is computed once per
forward in `AttentionPlan.build` and shared by every layer. A layer then does a
few big ops: write its new K/V into their slots in one copy, gather whole blocks
of each sequence into a padded `[seqs, blocks * block_size, kv_heads, head_dim]`
tensor, run `scaled_dot_product_attention` on it, and put the outputs back in
packed token order.

Sequences are split into two groups, so a long prefill does not make every decode
sequence pay for its padding: decode sequences (1 new token; the query heads are
folded onto their KV head, so GQA needs no copy) and prefill sequences (queries
padded to the longest one, GQA through `enable_gqa`). Decode attention is memory
bound, so its sequences go in chunks whose gathered K/V fit in the CPU cache: the
copy is read back from cache, not from memory. The mask is by position: the query
at position p sees cached token j iff j <= p, which is causal within the new
tokens, sees everything cached before them (continued/chunked prefill), and hides
the stale tail of each sequence's last block and the padding blocks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.instance.engine.forward_batch import ForwardBatch

DECODE_CHUNK_BYTES = 1 << 20  # gathered K+V per decode chunk; about one core's L2 cache


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    num_blocks: int  # blocks in the cache
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block's K (or V) in one layer

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "CacheGeometry":
        """From a cache `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(num_blocks, block_size, block_size * num_kv_heads * head_dim * kv_cache.element_size())


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


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    decode: AttentionGroup | None  # sequences with exactly one new token
    prefill: AttentionGroup | None  # sequences with more than one new token

    @classmethod
    def build(cls, batch: ForwardBatch, geometry: CacheGeometry) -> "AttentionPlan":
        query_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        starts = torch.cumsum(query_lens, 0) - query_lens
        if batch.is_decode_only:
            return cls(batch.slot_mapping, _decode_group(batch, None, starts, geometry), None)
        is_decode = query_lens == 1
        decode = None
        if bool(is_decode.any()):
            decode = _decode_group(batch, torch.nonzero(is_decode).flatten(), starts, geometry)
        prefill_seqs = torch.nonzero(~is_decode).flatten()
        return cls(batch.slot_mapping, decode, _prefill_group(batch, prefill_seqs, query_lens, starts, geometry))


def _gather_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, geometry: CacheGeometry, max_chunk_bytes: int | None
) -> tuple[int, tuple[slice, ...], tuple[torch.Tensor, ...]]:
    """(num_keys, chunks, gather_indices) for sequences with these block tables and contexts;
    max_chunk_bytes None: all sequences in one chunk."""
    num_blocks = (int(context_lens.max()) + geometry.block_size - 1) // geometry.block_size
    if block_tables.shape[1] < num_blocks:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, the longest context needs {num_blocks}")
    block_tables = block_tables[:, :num_blocks]
    num_seqs = block_tables.shape[0]
    chunk_seqs = num_seqs
    if max_chunk_bytes is not None:
        chunk_seqs = max(1, max_chunk_bytes // (2 * num_blocks * geometry.block_bytes))
    chunks = tuple(slice(i, min(i + chunk_seqs, num_seqs)) for i in range(0, num_seqs, chunk_seqs))
    flats = [block_tables[chunk].flatten() for chunk in chunks]
    indices = tuple(torch.cat((flat, flat + geometry.num_blocks)) for flat in flats)
    return num_blocks * geometry.block_size, chunks, indices


def _decode_group(
    batch: ForwardBatch, seqs: torch.Tensor | None, starts: torch.Tensor, geometry: CacheGeometry
) -> AttentionGroup:
    context_lens = batch.context_lens if seqs is None else batch.context_lens[seqs]
    block_tables = batch.block_tables if seqs is None else batch.block_tables[seqs]
    num_keys, chunks, indices = _gather_plan(block_tables, context_lens, geometry, DECODE_CHUNK_BYTES)
    mask = None
    if bool((context_lens != num_keys).any()):
        mask = (torch.arange(num_keys) < context_lens[:, None]).view(-1, 1, 1, num_keys)
    token_index = None if seqs is None else starts[seqs].view(-1, 1)  # a decode sequence's only token
    out_index = None if token_index is None else token_index.flatten()
    return AttentionGroup(num_keys, chunks, indices, mask, False, token_index, None, out_index)


def _prefill_group(
    batch: ForwardBatch, seqs: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor, geometry: CacheGeometry
) -> AttentionGroup:
    lens, context_lens = query_lens[seqs], batch.context_lens[seqs]
    num_keys, chunks, indices = _gather_plan(batch.block_tables[seqs], context_lens, geometry, None)
    offsets = torch.arange(int(lens.max()))
    is_valid = offsets < lens[:, None]
    token_index = torch.where(is_valid, starts[seqs][:, None] + offsets, 0)
    is_causal = bool((context_lens == lens).all())  # nothing cached before the new tokens
    mask = None
    if not is_causal:
        positions = batch.positions[token_index]  # padding rows take token 0's position: they see key 0 at least
        mask = (torch.arange(num_keys) <= positions[:, :, None]).unsqueeze(1)
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


def attend(q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """Attention of the new queries ([num_tokens, heads, head_dim]) over each sequence's cached
    context (already including the new tokens); returns [num_tokens, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    if plan.prefill is None:
        return _attend_decode(q, kv_layer, plan.decode, scale).view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if plan.decode is not None:
        out[plan.decode.out_index] = _attend_decode(q, kv_layer, plan.decode, scale).flatten(1)
    out[plan.prefill.out_index] = _attend_prefill(q, kv_layer, plan.prefill, scale)
    return out


def _gather(kv_layer: torch.Tensor, index: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the sequences `index` selects, each [num_seqs, kv_heads, num_keys, head_dim]."""
    _, num_cache_blocks, _, num_kv_heads, head_dim = kv_layer.shape
    kv = kv_layer.view(2 * num_cache_blocks, -1).index_select(0, index)
    kv = kv.view(2, -1, num_keys, num_kv_heads, head_dim)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _attend_decode(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    """One query per sequence; the query heads of a KV head become its query rows (GQA without copies)."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    if group.token_index is not None:
        q = q[group.token_index.flatten()]
    q = q.view(q.shape[0], num_kv_heads, -1, head_dim)
    if len(group.chunks) == 1:
        return _sdpa_decode(q, kv_layer, group, 0, scale).view(q.shape[0], -1, head_dim)
    out = q.new_empty(q.shape)
    for i, chunk in enumerate(group.chunks):
        out[chunk] = _sdpa_decode(q[chunk], kv_layer, group, i, scale)
    return out.view(q.shape[0], -1, head_dim)


def _sdpa_decode(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, i: int, scale: float) -> torch.Tensor:
    k, v = _gather(kv_layer, group.gather_indices[i], group.num_keys)
    mask = None if group.mask is None else group.mask[group.chunks[i]]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _attend_prefill(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    k, v = _gather(kv_layer, group.gather_indices[0], group.num_keys)
    num_seqs, max_query_len = group.token_index.shape
    q = q[group.token_index].transpose(1, 2)  # [num_seqs, heads, max_query_len, head_dim]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, is_causal=group.is_causal, scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, -1)
    return out if group.is_valid is None else out[group.is_valid]
