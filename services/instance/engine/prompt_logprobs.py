"""Prompt logprobs (`sampling.prompt_logprobs`): each prefill chunk's logits rows scored against the prompt
tokens they predict, added to the request's `prompt_logprobs` as the chunks are computed."""

from __future__ import annotations

import torch

from services.instance.engine.logprobs import token_logprobs
from services.instance.engine.scheduler import ScheduledRequest, SchedulerOutput

# Vocabulary-wide logits rows of prompt-logprobs prefills in one step (elements; fp32: 128 MiB, twice that
# with their log_softmax): 682 prompt tokens a step for a 49152-token vocabulary, 256 for 128k.
PROMPT_LOGITS_BUDGET = 1 << 25


def record_prompt_logprobs(scheduled: SchedulerOutput, logits: torch.Tensor) -> list[int]:
    """Add the prompt logprobs this step's prefill chunks computed to their requests (positions a
    preemption's recompute ran again are skipped); returns each scheduled request's last logits row."""
    last_rows = []
    row = 0
    for s, num_logits in zip(scheduled.scheduled, scheduled.batch.num_logits):
        row += num_logits
        last_rows.append(row - 1)
        if s.request.wants_prompt_logits:  # else its only row is its last token's
            _record_chunk(s, logits, first_row=row - num_logits)
    return last_rows


def _record_chunk(s: ScheduledRequest, logits: torch.Tensor, first_row: int) -> None:
    request = s.request
    stop = request.num_computed_tokens  # the chunk is positions [start, stop): row of position p predicts p + 1
    start = stop - s.num_new_tokens
    first = len(request.prompt_logprobs) + 1  # the next prompt token without its logprob
    targets = range(first, min(stop, request.num_prompt_tokens - 1) + 1) if first > start else range(0)
    rows = [first_row + target - 1 - start for target in targets]
    request.prompt_logprobs += token_logprobs(
        logits[rows], torch.tensor([request.prompt_token_ids[t] for t in targets], dtype=torch.int64),
        [request.sampling.prompt_logprobs] * len(rows))
