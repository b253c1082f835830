"""Continuous batching: which requests run in the next step, and with how many tokens.

Every step, in this order:

1. Running requests, decodes before unfinished prefills, each in priority order
   (higher `priority` first, then earlier arrival). Each gets as many of its
   uncomputed tokens as the step's token budget has left (`max_num_batched_tokens`),
   so long prompts are prefilled in chunks over several steps. A prefill chunk ends at
   the next multiple of `prefill_chunk_tokens` (or at the end of what is to compute) and
   waits a step where the budget left cannot take it whole: a prompt is cut at the same
   places alone and in a busy batch, so its K/V and first logits have the same bits
   either way (batch invariance; attention.py). `prefill_chunk_tokens` is by default half
   what a step leaves a prefill beside a full batch of decodes, in whole blocks, so a
   chunk never waits on decodes alone and a prompt arriving while one long prompt
   prefills takes its first chunk in the next step. (Prompt-logprobs prefills, which follow the logits rows a
   step has left, and chunks shrunk to the blocks left are cut where they must be; where
   the budget is less than a block above `max_num_seqs`, every chunk is cut where the
   budget ends, as decodes could take all of it.)
   A request computing its output tokens again (a resume, a preemption's recompute)
   has its prompt cut the same way, ending at the prompt's end, and then its output
   tokens in steps of their own, which attend one by one as decodes (forward_batch.py).
2. A running request that needs a block when none is free preempts the worst
   other running request (lowest priority, then latest arrival) that is worse than
   itself, taking it out of this step if it was scheduled already (as vLLM does: a
   high-priority prefill never preempts itself while worse decodes keep their blocks);
   if there is none, a prefill chunk shrinks to the blocks left, and a request that
   cannot take a single token preempts itself.
   Preemption is by recompute: the blocks are freed and the request goes back
   to waiting with the tokens it generated; its next prefill recomputes
   prompt + generated tokens. A request that would not fit even alone in the
   cache finishes with LENGTH (running, or at the head of the waiting queue, where
   a preempted one may have come with more tokens than the cache holds). With a
   sliding window on every layer, each running request first gives back the blocks
   behind its window (`BlockManager.drop_out_of_window`), and only its window must fit;
   a waiting one whose first chunk alone would not fit finishes with LENGTH too.
3. If nothing was preempted, waiting requests are admitted in priority order while
   batch slots (`max_num_seqs`, less those reserved for requests migrating in),
   budget and free blocks allow. The head of the
   queue blocks the rest (strict priority). With prefix caching, an admitted request
   starts from the cached blocks of its prefix and computes only the rest (unless it
   asked for prompt logprobs: those need every prompt position's logits); one admitted
   before (preempted) or computing its output tokens again starts from cached blocks ending
   at a chunk boundary of its prompt (or where it was first admitted from, if that is off
   one), and is cut where it was first admitted from too, or past its prompt: its prompt is
   cut where it was the first time.

A prefill that reports prompt logprobs needs a logits row per token (vocabulary-wide), so
such prefills share at most `max_prompt_logit_rows` tokens a step; the rest of their
prompt follows in later steps.

Scheduled tokens count as computed as soon as they are scheduled: the step that
`schedule()` returns must run.

Live migration takes a request out of both queues between two steps (`suspend`): it
keeps its blocks and its batch slot but is neither scheduled nor preempted until it is
`resume`d (the migration failed) or removed (it moved). A request migrating in joins
with its K/V already in its blocks (`adopt`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.instance.engine.block_manager import BlockId, BlockManager
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step: a prefill chunk, or 1 to decode
    is_sampled: bool  # the step reaches the end of the context, so its logits give the next token


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in batch order: the model's logits rows go scheduled[0]'s first
    batch: ForwardBatch | None  # None when nothing runs this step
    preempted: list[Request] = field(default_factory=list)  # moved back to waiting this step
    finished: list[Request] = field(default_factory=list)  # finished here: longer than the whole cache
    started: list[Request] = field(default_factory=list)  # admitted for the first time: first_start set this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


# Output tokens computed again in one step each attend on their own like a decode, gathering their context:
# as many a step as gather this many keys (SmolLM2: 48 MiB a layer; 130 tokens at 250 tokens of context).
RECOMPUTED_OUTPUT_KEYS = 32768


def prefill_chunk_size(max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                       requested: int = 0) -> int | None:
    """Prefill chunk boundaries: `requested`, or half the budget a step leaves beside `max_num_seqs` decodes,
    in whole blocks (so two prefills share a step: a short prompt arriving while a long one prefills
    starts at once); None where what is left is not a block (decodes could take all of it: chunks are cut
    where the budget ends). Raises ValueError for a `requested` size a step could not always take."""
    left = max_num_batched_tokens - max_num_seqs
    if requested:
        if not 0 < requested <= left:
            raise ValueError(f"--prefill-chunk-tokens must be between 1 and --max-num-batched-tokens less "
                             f"--max-num-seqs ({left}), got {requested}")
        return requested
    if left < block_size:
        return None
    return max(block_size, left // 2 // block_size * block_size)


def _priority_order(request: Request) -> tuple[int, int]:
    return (-request.priority, request.arrival_order)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prompt_logit_rows: int = 512, num_reserved_slots: Callable[[], int] = lambda: 0,
                 recomputes_one_by_one: bool = True, prefill_chunk_tokens: int = 0) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(f"--max-num-seqs and --max-num-batched-tokens must be positive, "
                             f"got {max_num_seqs} and {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prompt_logit_rows = max(1, max_prompt_logit_rows)  # prompt-logprobs prefill tokens a step
        self.prefill_chunk_tokens = prefill_chunk_size(max_num_batched_tokens, max_num_seqs,
                                                        block_manager.block_size, prefill_chunk_tokens)
        # Output tokens computed again attend one by one as decodes (the same bits; worth it where attention is
        # batch-invariant: on the CPU), else in one prefill.
        self.recomputes_one_by_one = recomputes_one_by_one
        self._num_reserved_slots = num_reserved_slots  # slots held for requests migrating in
        # Invariant: both queues stay sorted by _priority_order; running requests hold blocks, waiting ones none.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.suspended: list[Request] = []  # migrating out: blocks (and a running one's batch slot) kept, never scheduled
        self.num_preemptions = 0  # since start, for metrics

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_priority_order)

    def remove(self, request: Request, reason: FinishReason) -> None:
        """Take `request` out of whichever queue holds it, free its blocks and finish it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request)
        elif request.status is RequestStatus.SUSPENDED:
            self.suspended.remove(request)
            self.block_manager.free(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.num_computed_tokens = 0

    def suspend(self, request: Request) -> None:
        """Take a waiting or running request out of the batch at a step boundary, keeping its blocks."""
        queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        request.status = RequestStatus.SUSPENDED
        self.suspended.append(request)

    def resume(self, request: Request) -> None:
        """Put a suspended request back: running if it holds blocks, else waiting."""
        self.suspended.remove(request)
        self.adopt(request)

    def adopt(self, request: Request) -> None:
        """Add a request whose first `num_computed_tokens` tokens are already in its blocks."""
        if not request.block_table:
            self.add(request)
            return
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_priority_order)

    @property
    def num_busy_slots(self) -> int:
        """Batch slots taken: running requests and suspended (migrating) ones that were running. A waiting
        request moving out holds none: it goes back to the queue if its move fails."""
        return len(self.running) + sum(1 for r in self.suspended if r.block_table)

    @property
    def has_free_slot(self) -> bool:
        """A waiting request could join the batch: not every slot is running, suspended or held for a migration in."""
        return self.num_busy_slots + self._num_reserved_slots() < self.max_num_seqs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_blocks_needed_by_waiting(self) -> int:
        """Blocks the waiting requests will hold (with a window on every layer, each its window's at most)."""
        return sum(self.block_manager.max_blocks_held(r.num_tokens) for r in self.waiting)

    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(budget=self.max_num_batched_tokens, logit_budget=self.max_prompt_logit_rows)
        if self.block_manager.window is not None:  # no window: nothing to give back (a hot path)
            for request in self.running:
                self.block_manager.drop_out_of_window(request)
        decodes_first = sorted(self.running, key=lambda r: (r.num_uncomputed_tokens > 1, _priority_order(r)))
        for request in decodes_first:
            if step.budget == 0:
                break
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                self._schedule_running(request, step)
        if not step.preempted:
            self._admit_waiting(step)
        for scheduled in step.scheduled:
            scheduled.request.num_computed_tokens += scheduled.num_new_tokens
        return step.to_output(self.block_manager.block_size, self.recomputes_one_by_one)

    def _schedule_running(self, request: Request, step: _StepPlan) -> None:
        if self._is_plain_decode(request) and step.budget_for(request):
            step.add(request, 1)  # what the general path below comes to for it, without its checks
            return
        if self._finished_as_too_long(request, step):
            return
        num_new = self._chunk(request, request.num_computed_tokens,
                              min(request.num_uncomputed_tokens, step.budget_for(request)))
        if num_new == 0:
            return  # its chunk does not fit in what the step has left: next step
        self._make_room(request, request.num_computed_tokens + num_new, step)
        num_new = min(num_new, self._num_tokens_that_fit(request))  # a prefill chunk may shrink
        if num_new == 0:
            self._preempt(request, step)
            return
        self.block_manager.allocate(request, request.num_computed_tokens + num_new)
        step.add(request, num_new)

    def _is_plain_decode(self, request: Request) -> bool:
        """One token left to compute, and its blocks hold it: nothing to cut, allocate or preempt (the
        common step of a running request, taken without `_schedule_running`'s general path)."""
        return (request.num_uncomputed_tokens == 1
                and len(request.block_table) * self.block_manager.block_size >= request.num_tokens)

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        """The tokens from `start` to the next chunk boundary (or the prompt's end, or the end, or `first_start`:
        a recompute starting below where the request first started is cut there too) if `num_new` reaches them,
        else 0. Output tokens computed again attend one by one (forward_batch.py): any cut
        gives them the same bits, and a step takes as many as gather RECOMPUTED_OUTPUT_KEYS keys in all."""
        if request.wants_prompt_logits or self.prefill_chunk_tokens is None:
            return num_new
        if start >= request.num_prompt_tokens and self.recomputes_one_by_one:
            return min(num_new, max(1, RECOMPUTED_OUTPUT_KEYS // (start + num_new)))
        prompt_end = request.num_prompt_tokens if start < request.num_prompt_tokens else request.num_tokens
        end = min(prompt_end, (start // self.prefill_chunk_tokens + 1) * self.prefill_chunk_tokens)
        if request.first_start is not None and start < request.first_start:
            end = min(end, request.first_start)
        return end - start if start + num_new >= end else 0

    def _finished_as_too_long(self, request: Request, step: _StepPlan) -> bool:
        """Finish `request` with LENGTH if it could never fit, even alone in the cache (with a window on every
        layer, its window must: prefill chunks shrink to the blocks left)."""
        if self.block_manager.max_blocks_held(request.num_tokens) <= self.block_manager.num_blocks:
            return False
        self.remove(request, FinishReason.LENGTH)
        step.finished.append(request)
        return True

    def _chunk_never_fits(self, request: Request, start: int, end: int, step: _StepPlan) -> bool:
        """Finish `request` with LENGTH if its first chunk (tokens `start` to `end`) would not fit even alone in the
        cache: a prompt longer than the cache that its window fits (`_finished_as_too_long` lets it by) whose
        chunk is longer than the cache, which an engine built without the factory's check may be given."""
        if self.block_manager.num_blocks_for_chunk(start, end) <= self.block_manager.num_blocks:
            return False
        self.remove(request, FinishReason.LENGTH)
        step.finished.append(request)
        return True

    def _make_room(self, request: Request, num_tokens: int, step: _StepPlan) -> None:
        """Preempt worse requests until `request` can hold `num_tokens` tokens, or none is left."""
        while not self.block_manager.can_allocate(self.block_manager.num_blocks_needed(request, num_tokens)):
            victim = self._pick_victim(request)
            if victim is None:
                return
            self._preempt(victim, step)

    def _num_tokens_that_fit(self, request: Request) -> int:
        """New tokens `request` can take with its blocks plus every free block."""
        num_blocks = len(request.block_table) + self.block_manager.num_free_blocks
        return num_blocks * self.block_manager.block_size - request.num_computed_tokens

    def _pick_victim(self, request: Request) -> Request | None:
        """The worst running request, if it is worse than `request`."""
        worst = self.running[-1]
        return worst if _priority_order(worst) > _priority_order(request) else None

    def _preempt(self, request: Request, step: _StepPlan) -> None:
        step.unschedule(request)  # its blocks (this step's included) go; its tokens were not counted yet
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)
        step.preempted.append(request)

    def _admit_waiting(self, step: _StepPlan) -> None:
        while self.waiting and step.budget > 0 and self.has_free_slot:
            request = self.waiting[0]
            if self._finished_as_too_long(request, step):
                continue
            cached = [] if request.wants_prompt_logits else self._cached_start(request)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_new = self._chunk(request, num_cached_tokens,
                                  min(request.num_tokens - num_cached_tokens, step.budget_for(request)))
            if num_new > 0 and self._chunk_never_fits(request, num_cached_tokens, num_cached_tokens + num_new, step):
                continue
            if num_new == 0 or not self.block_manager.can_allocate(self.block_manager.num_blocks_to_admit(cached, num_cached_tokens
                                                                                          + num_new)):
                return
            self.waiting.pop(0)
            self.block_manager.start_from_cache(request, cached)
            self.block_manager.drop_out_of_window(request)  # cached blocks behind the window go back at once
            if request.first_start is None:
                request.first_start = num_cached_tokens
                step.started.append(request)
            self.block_manager.allocate(request, num_cached_tokens + num_new)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_priority_order)
            step.add(request, num_new)

    def _cached_start(self, request: Request) -> list[BlockId]:
        """The cached blocks `request` starts from. One admitted here before (a preemption's recompute, also
        during its prefill) or computing its output tokens again (a resume) starts where its prompt was cut the
        first time: at the last chunk boundary cached (its chunks are cut at `first_start` too), or past its
        prompt; at `first_start` (where its prompt was first computed from) where that is not a chunk boundary
        and is cached: its rows after it have bits of their own, and the blocks cached there may be a sibling's,
        cut at the chunk boundary. A chunk starting elsewhere in the prompt (after blocks still cached while
        later ones were evicted, or at a sibling's last cached block) gives its rows other bits, as attention
        sums a chunk's rows in blocks of its own, so the request went on with other logprobs."""
        cached = self.block_manager.cached_prefix(request)
        num_cached_tokens = len(cached) * self.block_manager.block_size
        is_new = request.first_start is None and request.num_output_tokens == 0
        if is_new or self.prefill_chunk_tokens is None or num_cached_tokens >= request.num_prompt_tokens:
            return cached
        first_start = request.first_start
        if first_start is not None and num_cached_tokens >= first_start and first_start % self.prefill_chunk_tokens:
            return cached[:first_start // self.block_manager.block_size]
        step = math.lcm(self.prefill_chunk_tokens, self.block_manager.block_size)
        return cached[:num_cached_tokens // step * step // self.block_manager.block_size]


@dataclass(slots=True)
class _StepPlan:
    """The step being put together."""

    budget: int  # tokens still allowed this step
    logit_budget: int  # of which prompt-logprobs prefills may still take (each of their tokens is a logits row)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_new_tokens: int) -> None:
        is_sampled = request.num_computed_tokens + num_new_tokens == request.num_tokens
        self.scheduled.append(ScheduledRequest(request, num_new_tokens, is_sampled))
        self.budget -= num_new_tokens
        if request.wants_prompt_logits:
            self.logit_budget -= num_new_tokens

    def unschedule(self, request: Request) -> None:
        """Take `request` out of this step (it is being preempted), giving its tokens back to the budget."""
        entry = next((s for s in self.scheduled if s.request is request), None)
        if entry is None:
            return
        self.scheduled.remove(entry)
        self.budget += entry.num_new_tokens
        if request.wants_prompt_logits:
            self.logit_budget += entry.num_new_tokens

    def budget_for(self, request: Request) -> int:
        return min(self.budget, self.logit_budget) if request.wants_prompt_logits else self.budget

    def to_output(self, block_size: int, recomputes_one_by_one: bool) -> SchedulerOutput:
        """Call after the scheduled tokens were counted as computed."""
        batch = build_forward_batch(self.scheduled, block_size, recomputes_one_by_one) if self.scheduled else None
        return SchedulerOutput(self.scheduled, batch, self.preempted, self.finished, self.started)


def build_forward_batch(scheduled: list[ScheduledRequest], block_size: int, recomputes_one_by_one: bool = True
                        ) -> ForwardBatch:
    """The packed model input of the scheduled chunks (their tokens already count as computed), as
    host tensors: the model moves what it needs to its device."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in scheduled:
        request, stop = s.request, s.request.num_computed_tokens
        start = stop - s.num_new_tokens
        input_ids += request.token_ids(start, stop)
        positions += range(start, stop)
        slots += [request.block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]
    max_blocks = max(len(s.request.block_table) for s in scheduled)
    block_tables = [s.request.block_table + [0] * (max_blocks - len(s.request.block_table)) for s in scheduled]

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        query_lens=[s.num_new_tokens for s in scheduled],
        context_lens=tensor([s.request.num_computed_tokens for s in scheduled]),
        block_tables=tensor(block_tables),
        logit_lens=([s.num_new_tokens if s.request.wants_prompt_logits else 1 for s in scheduled]
                    if any(s.request.wants_prompt_logits for s in scheduled) else None),
        decode_tails=[_num_output_tokens_in(s) for s in scheduled] if recomputes_one_by_one else None,
        is_prompt_chunk=[s.request.num_computed_tokens - s.num_new_tokens < s.request.num_prompt_tokens
                         for s in scheduled],
    )


def _num_output_tokens_in(s: ScheduledRequest) -> int:
    """How many of the chunk's tokens are output tokens (computed again, where more than one)."""
    stop = s.request.num_computed_tokens
    return max(0, stop - max(stop - s.num_new_tokens, s.request.num_prompt_tokens))
