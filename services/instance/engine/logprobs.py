"""Logprobs of given tokens: the chosen token's and the most likely ones, from raw logits.

Both the sampler (each new token) and the prefill (each prompt token, for
`prompt_logprobs`) report them this way: `log_softmax` of the model's logits, with no
penalty, bias, temperature or top-k/top-p applied, like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int  # the chosen (or prompt) token
    logprob: float
    top_token_ids: tuple[int, ...]  # the n most likely tokens, most likely first (equal logprobs: lower id first)
    top_logprobs: tuple[float, ...]
    rank: int = 1  # 1 + how many tokens are strictly more likely than token_id


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprob]:
    """Row i: the logprob of `token_ids[i]` under `logits[i]`, and the `num_top[i]` most likely tokens."""
    if not len(num_top):
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    most = min(max(num_top), logits.shape[1])
    top_values, top_ids = _top(logprobs, most) if most else (logprobs[:, :0],) * 2
    ids, chosen_values = token_ids.tolist(), chosen.squeeze(1).tolist()
    return [TokenLogprob(token_id=int(ids[i]), logprob=chosen_values[i], top_token_ids=tuple(top_ids[i, :n].tolist()),
                         top_logprobs=tuple(top_values[i, :n].tolist()), rank=ranks[i])
            for i, n in enumerate(num_top)]


def _top(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` largest logprobs and their token ids, ties by token id ascending. `topk` alone orders equal
    values as it pleases (another batch, after a migration or a resume, gave another order): here it takes every
    token tied with the k-th too, sorts those by id, then stably by logprob."""
    kth = logprobs.topk(k, dim=-1).values[:, -1:]
    num_candidates = int((logprobs >= kth).sum(dim=1).max())
    values, ids = logprobs.topk(num_candidates, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(1, order)[:, :k]
