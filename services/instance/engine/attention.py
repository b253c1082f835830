"""Paged attention in plain PyTorch: the per-step plan and the per-layer kernel.

Design: everything that depends only on the batch (which tokens belong to which
sequence, which cache blocks each sequence reads, the causal mask) is computed
once per forward in `AttentionPlan.build` and shared by every layer. A layer
then does a few big ops: write its new K/V into their slots, gather each
sequence's blocks into a padded `[seqs, blocks * block_size, kv_heads, head_dim]`
view, run `scaled_dot_product_attention` with a boolean mask, and put the
outputs back in packed token order.

Sequences are split into two groups, so a long prefill does not make every decode
sequence pay for its padding: decode sequences (1 new token; the query heads are
folded onto their KV head, so GQA needs no copy) and prefill sequences (queries
padded to the longest one, GQA through `enable_gqa`). The mask is by position:
the query at position p sees cached token j iff j <= p, which is causal within
the new tokens, sees everything cached before them (continued/chunked prefill),
and hides the stale tail of each sequence's last block and the padding blocks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.instance.engine.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    block_tables: torch.Tensor  # [num_seqs, num_blocks] cache blocks each sequence reads, padded with 0
    gather_index: torch.Tensor  # [2 * num_seqs * num_blocks] rows of the layer's cache viewed as [2 * blocks, -1]: K, then V
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, num_blocks * block_size] bool, True = visible; None: is_causal, or every key visible
    is_causal: bool  # no mask needed: every sequence starts at position 0, so query i sees keys 0..i
    token_index: torch.Tensor | None  # [num_seqs, max_query_len] packed token of each query row; None = all tokens in order
    is_valid: torch.Tensor | None  # [num_seqs * max_query_len] bool, False for padding rows; None = no padding
    out_index: torch.Tensor | None  # [num_valid] packed token each valid row belongs to; None = all tokens in order


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot for each new token
    decode: AttentionGroup | None  # sequences with exactly one new token
    prefill: AttentionGroup | None  # sequences with more than one new token

    @classmethod
    def build(cls, batch: ForwardBatch, num_cache_blocks: int, block_size: int) -> "AttentionPlan":
        query_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        starts = torch.cumsum(query_lens, 0) - query_lens
        is_decode = query_lens == 1
        if batch.is_decode_only:
            return cls(batch.slot_mapping, _decode_group(batch, None, starts, num_cache_blocks, block_size), None)
        decode = None
        if bool(is_decode.any()):
            decode_seqs = torch.nonzero(is_decode).flatten()
            decode = _decode_group(batch, decode_seqs, starts, num_cache_blocks, block_size)
        prefill_seqs = torch.nonzero(~is_decode).flatten()
        prefill = _prefill_group(batch, prefill_seqs, query_lens, starts, num_cache_blocks, block_size)
        return cls(batch.slot_mapping, decode, prefill)


def _block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_cache_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables cut to the blocks in use, and the rows that gather them (K rows, then V rows)."""
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    if block_tables.shape[1] < num_blocks:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, the longest context needs {num_blocks}")
    block_tables = block_tables[:, :num_blocks]
    flat = block_tables.flatten()
    return block_tables, torch.cat((flat, flat + num_cache_blocks))


def _decode_group(
    batch: ForwardBatch, seqs: torch.Tensor | None, starts: torch.Tensor, num_cache_blocks: int, block_size: int
) -> AttentionGroup:
    context_lens = batch.context_lens if seqs is None else batch.context_lens[seqs]
    block_tables = batch.block_tables if seqs is None else batch.block_tables[seqs]
    block_tables, gather_index = _block_tables(block_tables, context_lens, num_cache_blocks, block_size)
    num_keys = block_tables.shape[1] * block_size
    mask = None
    if bool((context_lens != num_keys).any()):
        mask = torch.arange(num_keys) < context_lens[:, None]
        mask = mask.view(-1, 1, 1, num_keys)
    token_index = None if seqs is None else starts[seqs].view(-1, 1)  # a decode sequence's only token
    out_index = None if token_index is None else token_index.flatten()
    return AttentionGroup(block_tables, gather_index, mask, False, token_index, None, out_index)


def _prefill_group(
    batch: ForwardBatch,
    seqs: torch.Tensor,
    query_lens: torch.Tensor,
    starts: torch.Tensor,
    num_cache_blocks: int,
    block_size: int,
) -> AttentionGroup:
    lens = query_lens[seqs]
    context_lens = batch.context_lens[seqs]
    block_tables, gather_index = _block_tables(batch.block_tables[seqs], context_lens, num_cache_blocks, block_size)
    num_keys = block_tables.shape[1] * block_size
    offsets = torch.arange(int(lens.max()))
    is_valid = offsets < lens[:, None]
    token_index = torch.where(is_valid, starts[seqs][:, None] + offsets, 0)
    is_causal = bool((context_lens == lens).all())  # nothing cached before the new tokens
    mask = None
    if not is_causal:
        positions = batch.positions[token_index]  # padding rows read token 0's position: they see key 0 at least
        mask = (torch.arange(num_keys) <= positions[:, :, None]).unsqueeze(1)
    is_valid = is_valid.flatten()
    out_index = token_index.flatten()[is_valid]
    if bool(is_valid.all()):
        is_valid = None
    return AttentionGroup(block_tables, gather_index, mask, is_causal, token_index, is_valid, out_index)


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


def _gather(kv_layer: torch.Tensor, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V as [num_seqs, kv_heads, num_keys, head_dim], in one whole-block copy."""
    num_seqs, num_blocks = group.block_tables.shape
    _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    kv = kv_layer.view(2 * num_cache_blocks, -1).index_select(0, group.gather_index)
    kv = kv.view(2, num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _attend_decode(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    """One query per sequence; the query heads of a KV head become its query rows (GQA without copies)."""
    k, v = _gather(kv_layer, group)
    num_seqs, num_kv_heads, _, head_dim = k.shape
    if group.token_index is not None:
        q = q[group.token_index.flatten()]
    q = q.view(num_seqs, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
    return out.view(num_seqs, -1, head_dim)


def _attend_prefill(q: torch.Tensor, kv_layer: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    k, v = _gather(kv_layer, group)
    num_seqs, max_query_len = group.token_index.shape
    head_dim = q.shape[-1]
    q = q[group.token_index].transpose(1, 2)  # [num_seqs, heads, max_query_len, head_dim]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, is_causal=group.is_causal, scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, -1)
    return out if group.is_valid is None else out[group.is_valid]
