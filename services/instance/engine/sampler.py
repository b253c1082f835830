"""Each sequence's next token from its logits: greedy, or seeded sampling that resumes anywhere.

Randomness: the noise for output token i of a request comes from a generator seeded
with `mix(seed, i)` and nothing else. So a request samples the same tokens whatever
else is in the batch, and a request resumed at token i on another instance (same
torch build) continues exactly as it would have. Sampling is the exponential race:
`argmax(p / q)` with `q ~ Exp(1)` i.i.d. picks token j with probability `p_j`.

Penalties and logit biases (OpenAI semantics) adjust the logits before any choice, greedy
included: `logit -= frequency_penalty * count + presence_penalty * (count > 0)` with
`count` the times the token is in the request's output so far (resumed tokens included,
the prompt not), then `logit += bias`. vLLM's `repetition_penalty` p (1 = off) comes first
and covers prompt and output: a seen token's logit is divided by p if positive, else
multiplied by it. All of these depend only on the request's own tokens, so a moved or
resumed request is adjusted exactly as it would have been. `min_p` (sampled rows only)
drops tokens whose probability is below `min_p` times the most likely token's. A row's
`banned_token_ids` (vLLM's `min_tokens`: eos and stop token ids while the output is
shorter) get -inf, so they are never chosen. Last, a row with a grammar (`allowed`, see
guided.py) gets -inf for every token the grammar does not allow next; the grammar wins over
`banned_token_ids` (where the grammar allows only eos, the text is complete: eos it is).

Logprobs are those of the raw logits (`log_softmax`; penalties, biases, temperature and
top-k/top-p not applied), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.instance.engine.logprobs import TokenLogprob, token_logprobs
from services.instance.engine.request import SamplingParams

_MASK64 = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    seed: int  # the request's effective seed
    token_index: int  # output index of the token being sampled
    output_token_ids: Sequence[int] = ()  # the output so far (for penalties)
    prompt_token_ids: Sequence[int] = ()  # for the repetition penalty
    banned_token_ids: Sequence[int] = ()  # may not be chosen (min_tokens holds back eos and stop token ids)
    allowed: torch.Tensor | None = None  # bool [vocab]: the only tokens its grammar allows (None = all)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # None unless the request asked for logprobs


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Sample one token per row of `logits` [num_rows, vocab]."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
        logits = logits.float().cpu()
        token_ids = self._choose(adjusted_logits(logits, rows), rows)
        logprobs = _logprobs(logits, token_ids, rows)
        return [SampledToken(token_id, logprob) for token_id, logprob in zip(token_ids.tolist(), logprobs)]

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return token_ids
        params = [rows[i].params for i in random_rows]
        scaled = logits[random_rows] / torch.tensor([p.temperature for p in params]).unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.stack([exponential_noise(logits.shape[1], rows[i].seed, rows[i].token_index)
                             for i in random_rows])
        token_ids[random_rows] = (probs / noise).argmax(dim=-1)
        return token_ids


def adjusted_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` with each row's penalties and biases applied (a copy if any row has them)."""
    adjusted_rows = [i for i, row in enumerate(rows)
                     if row.params.adjusts_logits or row.banned_token_ids or row.allowed is not None]
    if not adjusted_rows:
        return logits
    logits = logits.clone()
    vocab_size = logits.shape[1]
    for i in adjusted_rows:
        params = rows[i].params
        if params.repetition_penalty != 1.0:
            _penalize_repetitions_(logits[i], rows[i], params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and rows[i].output_token_ids:
            output = torch.tensor(rows[i].output_token_ids, dtype=torch.int64)
            counts = torch.bincount(output, minlength=vocab_size)[:vocab_size]
            logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)  # a token listed twice (over gRPC) takes both biases
            logits[i].index_add_(0, torch.tensor(ids), torch.tensor(biases, dtype=logits.dtype))
        _disallow_(logits[i], rows[i])
    return logits


def _disallow_(logits: torch.Tensor, row: SamplingRow) -> None:
    """-inf for the row's banned tokens, then for what its grammar does not allow (banned ones stay allowed where
    the grammar allows nothing else)."""
    allowed = row.allowed
    if row.banned_token_ids:
        banned = torch.tensor(row.banned_token_ids, dtype=torch.int64)
        if allowed is None:
            logits[banned] = float("-inf")
        else:
            narrowed = allowed.clone()
            narrowed[banned] = False
            allowed = narrowed if narrowed.any() else allowed
    if allowed is not None:
        logits.masked_fill_(~allowed, float("-inf"))


def _penalize_repetitions_(logits: torch.Tensor, row: SamplingRow, penalty: float) -> None:
    seen = torch.tensor([*row.prompt_token_ids, *row.output_token_ids], dtype=torch.int64).unique()
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def exponential_noise(vocab_size: int, seed: int, token_index: int) -> torch.Tensor:
    """Exp(1) noise for output token `token_index` of a request seeded `seed`."""
    generator = torch.Generator().manual_seed(mix_seed(seed, token_index))
    return torch.rand(vocab_size, generator=generator).log_().neg_()  # u = 0 gives +inf: never chosen


def mix_seed(seed: int, token_index: int) -> int:
    """A 64-bit seed for one (seed, token index) pair (splitmix64 finalizer)."""
    z = (seed + (token_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.tensor([vocab_size if n <= 0 else min(n, vocab_size) for n in top_k])
    kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside_nucleus = cumulative <= 1.0 - torch.tensor(top_p).unsqueeze(1)
    outside_nucleus[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs > 0]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    entries = token_logprobs(logits[wanted], token_ids[wanted], [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, entries):
        result[i] = entry
    return result
