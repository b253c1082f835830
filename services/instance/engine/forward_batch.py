"""The contract between the scheduler and the model: one forward pass.

A step runs some sequences' new tokens through the model at once. Prefill
sequences contribute many tokens, decode sequences one. Tokens of all sequences
are concatenated ("packed") in sequence order; nothing is padded.

The KV cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]` (index 0 of dim 1 is K, 1 is V). Token t of a sequence lives in
block `block_table[t // block_size]` at offset `t % block_size`; its flat slot is
`block * block_size + offset`.

Recomputed output tokens (a resume after a failure, a preemption's recompute, a request
that moved while queued) are fed many at once but attend one by one, each as the decode
step that first computed it did (`decode_tails`, `attention_view`): their K/V, and the
logits of the last, get the bits they had, so the request goes on with the same tokens.
"""

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from services.instance.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64, new tokens of every sequence, packed
    positions: torch.Tensor  # [num_tokens] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot where each new token's K/V is written
    query_lens: list[int]  # per sequence: how many new tokens it has in input_ids (sum = num_tokens)
    context_lens: torch.Tensor  # [num_seqs] int64, tokens in cache after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each sequence's blocks
    # Per sequence: how many of its last new tokens need logits (default: 1, its last token; a prefill
    # that reports prompt logprobs asks for all of its tokens).
    logit_lens: list[int] | None = None
    # Per sequence: how many of its last new tokens are output tokens computed again, which attend one by
    # one as decode steps did (None: none; a plain decode's one token counts or not, alike).
    decode_tails: list[int] | None = None
    # Per sequence: its new tokens end inside the prompt (a prefill chunk). Such a chunk attends as a prefill
    # even when it is one token long (the prompt's last token after a cached prefix, say), with the bits it
    # has within a longer chunk; the decode path, which other one-token sequences take, gives other bits.
    # None: only sequences with more than one new token are prefills.
    is_prompt_chunk: list[bool] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_logits(self) -> list[int]:
        return self.logit_lens if self.logit_lens is not None else [1] * self.num_seqs

    def logit_indices(self) -> torch.Tensor:
        """Indexes into the packed tokens of the tokens whose logits the model returns, in order."""
        ends = torch.cumsum(torch.tensor(self.query_lens, dtype=torch.int64), 0)
        if self.logit_lens is None:
            return ends - 1
        return torch.cat([torch.arange(end - n, end) for end, n in zip(ends.tolist(), self.logit_lens)])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens) and not any(self.is_prompt_chunk or ())

    def is_decode(self) -> list[bool]:
        """Per sequence: whether it attends as a decode (one new token, not a prompt token)."""
        prompt = self.is_prompt_chunk or [False] * self.num_seqs
        return [n == 1 and not is_prompt for n, is_prompt in zip(self.query_lens, prompt)]

    def attention_view(self) -> "ForwardBatch":
        """The batch as attention sees it: each decode tail split into one-token sequences, token i
        seeing the context up to itself (the tokens stay where they are in the packed order)."""
        tails = self.decode_tails
        if tails is None or all(tail == 0 or n == 1 for n, tail in zip(self.query_lens, tails)):
            return self
        query_lens: list[int] = []
        context_lens: list[int] = []
        rows: list[int] = []
        is_prompt_chunk: list[bool] = []
        for seq, (n, tail) in enumerate(zip(self.query_lens, tails)):
            context = int(self.context_lens[seq])
            entries = ([(n - tail, context - tail, True)] if n > tail else []) + \
                [(1, context - tail + i + 1, False) for i in range(tail)]
            query_lens += [length for length, _, _ in entries]
            context_lens += [context_len for _, context_len, _ in entries]
            is_prompt_chunk += [is_prompt for _, _, is_prompt in entries]
            rows += [seq] * len(entries)
        return replace(self, query_lens=query_lens, context_lens=torch.tensor(context_lens, dtype=torch.int64),
                       block_tables=self.block_tables[rows], logit_lens=None, decode_tails=None,
                       is_prompt_chunk=is_prompt_chunk)


class ForwardModel(Protocol):
    """What the engine runs each step: `LlamaModel` (torch engine) or `SimModel` (sim engine)."""

    config: ModelConfig

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """float32 logits [sum(batch.num_logits), vocab]: each sequence's last `num_logits` new tokens' (one row a
        sequence by default: its last token's), sequences in order; writes the new K/V to kv_cache."""
        ...
