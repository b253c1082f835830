"""The contract between the scheduler and the model: one forward pass.

A step runs some sequences' new tokens through the model at once. Prefill
sequences contribute many tokens, decode sequences one. Tokens of all sequences
are concatenated ("packed") in sequence order; nothing is padded.

The KV cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]` (index 0 of dim 1 is K, 1 is V). Token t of a sequence lives in
block `block_table[t // block_size]` at offset `t % block_size`; its flat slot is
`block * block_size + offset`.
"""

from dataclasses import dataclass
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
        return all(n == 1 for n in self.query_lens)


class ForwardModel(Protocol):
    """What the engine runs each step: `LlamaModel` (torch engine) or `SimModel` (sim engine)."""

    config: ModelConfig

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """float32 logits [sum(batch.num_logits), vocab]: each sequence's last `num_logits` new tokens' (one row a
        sequence by default: its last token's), sequences in order; writes the new K/V to kv_cache."""
        ...
