"""One engine step: schedule (which requests, how many tokens) → run the model → sample and finish requests.

`StepRunner` runs the model and the sampler and decides, for each request a step ran, its output and whether it
stops (finish_rules.py); a request that stops leaves the scheduler here and the engine's request table through
`forget`. Prompt logprobs are recorded as prefill chunks are computed (prompt_logprobs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from services.instance.engine.finish_rules import banned_token_ids, reason_when_too_long, stop_reason
from services.instance.engine.forward_batch import ForwardModel
from services.instance.engine.kv_cache import KvCache
from services.instance.engine.logprobs import TokenLogprob
from services.instance.engine.prompt_logprobs import record_prompt_logprobs
from services.instance.engine.request import FinishReason, Request
from services.instance.engine.sampler import SampledToken, Sampler, SamplingRow
from services.instance.engine.scheduler import Scheduler, SchedulerOutput
from services.instance.engine.step_output import StepOutput, step_output

log = structlog.get_logger(__name__)


class StepRunner:
    def __init__(self, model: ForwardModel, kv_cache: KvCache, scheduler: Scheduler, eos_token_ids: frozenset[int],
                 max_model_len: int, forget: Callable[[Request], None]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._forget = forget  # a finished request leaves the engine's table
        # The last step had nothing to do: the waiting requests cannot be admitted until blocks or slots are freed.
        self.last_step_was_idle = False
        self.num_grammar_dead_ends = 0  # requests stopped where their grammar allowed no token (or refused one)

    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule()
        self.last_step_was_idle = scheduled.batch is None and not scheduled.finished and not scheduled.preempted
        logits = self._run(scheduled)
        self._register_computed(scheduled)
        return self._postprocess(scheduled, logits)

    def _run(self, scheduled: SchedulerOutput) -> torch.Tensor | None:
        if scheduled.batch is None:
            return None
        with torch.inference_mode():
            return self.model(scheduled.batch, self.kv_cache.tensor)

    def _register_computed(self, scheduled: SchedulerOutput) -> None:
        """The step wrote its K/V: blocks it filled become findable by later requests (not by this step's)."""
        for s in scheduled.scheduled:
            self.scheduler.block_manager.register_computed(s.request)

    def _postprocess(self, scheduled: SchedulerOutput, logits: torch.Tensor | None) -> list[StepOutput]:
        outputs = [self._output_too_long(request) for request in scheduled.finished]
        outputs += self._start_notices(scheduled)
        if logits is None or scheduled.batch is None:
            return outputs
        last_rows = record_prompt_logprobs(scheduled, logits)
        sampled = [(s.request, row) for s, row in zip(scheduled.scheduled, last_rows) if s.is_sampled]
        allowed = {r.request_id: r.guide.allowed() for r, _row in sampled if r.guide is not None}
        for request in [r for r, _row in sampled if r.request_id in allowed and not allowed[r.request_id].any()]:
            outputs.append(self._end_at_grammar_dead_end(request))
        sampled = [(r, row) for r, row in sampled if not r.is_finished]
        if not sampled:
            return outputs
        sampling_rows = [SamplingRow(r.sampling, r.seed, r.num_output_tokens, r.output_token_ids, r.prompt_token_ids,
                                     banned_token_ids(r, self.eos_token_ids), allowed.get(r.request_id)) for r, _row in sampled]
        rows = [row for _r, row in sampled]
        # every row in order (a batch of decodes): no copy of the logits (32 x 49k floats: ~1 ms a step)
        tokens = self.sampler(logits if rows == list(range(len(logits))) else logits[rows], sampling_rows)
        for (request, _row), token in zip(sampled, tokens):
            outputs.append(self._append_token(request, token))
        return outputs

    def _start_notices(self, scheduled: SchedulerOutput) -> list[StepOutput]:
        """A token-less output for each request whose prompt this step started computing (`first_start` just
        set) without sampling its first token (a chunked prefill): a client that loses this instance before that
        token still learns where the prompt was first computed from, and its resume sends it back, so the prompt
        is cut there again (its logprobs keep their bits). Where the token comes in this step, its output says it."""
        sampled = {id(s.request) for s in scheduled.scheduled if s.is_sampled}
        return [self._output(r, r.num_output_tokens, None, None) for r in scheduled.started if id(r) not in sampled]

    def _append_token(self, request: Request, token: SampledToken) -> StepOutput:
        token_index = request.num_output_tokens
        prompt_logprobs = tuple(request.prompt_logprobs) if request.wants_prompt_logits else None
        request.prompt_logprobs = []  # sent now: never again
        request.output_token_ids.append(token.token_id)
        if request.guide is not None and not request.guide.accept(token.token_id):
            self.num_grammar_dead_ends += 1
            log.warning("grammar_refused_sampled_token", request_id=request.request_id, error=request.guide.error)
        reason = stop_reason(request, token.token_id, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.scheduler.remove(request, reason)
        return self._output(request, token_index, token, reason, prompt_logprobs)

    def _end_at_grammar_dead_end(self, request: Request) -> StepOutput:
        """The grammar allows no token of this vocabulary (see guided.py on special tokens): stop here."""
        self.num_grammar_dead_ends += 1
        log.warning("grammar_allows_no_token", request_id=request.request_id, num_output_tokens=request.num_output_tokens)
        self.scheduler.remove(request, FinishReason.STOP)
        return self._output(request, request.num_output_tokens, None, FinishReason.STOP)

    def _output_too_long(self, request: Request) -> StepOutput:
        """A request the scheduler ended for outgrowing the whole cache (see `reason_when_too_long`)."""
        request.finish_reason = reason_when_too_long(request)
        return self._output(request, request.num_output_tokens, None, request.finish_reason)

    def _output(self, request: Request, token_index: int, token: SampledToken | None, reason: FinishReason | None,
                prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> StepOutput:
        if reason is not None:
            self._forget(request)
        return step_output(request, token_index, token, reason, prompt_logprobs)
