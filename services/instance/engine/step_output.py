"""`StepOutput`: what a step (or an abort) says about one request: its new token, text and finish reason."""

from __future__ import annotations

from dataclasses import dataclass

from services.instance.engine.logprobs import TokenLogprob
from services.instance.engine.request import FinishReason, Request, RequestId
from services.instance.engine.sampler import SampledToken


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: RequestId
    token_index: int  # output index of new_token_ids[0] (resumed tokens count)
    new_token_ids: tuple[int, ...]  # empty when the request finished without a new token, or started (first_start)
    text: str  # detokenized delta
    finish_reason: FinishReason | None  # None while the request runs
    logprobs: tuple[TokenLogprob, ...] | None  # one per new token, if the request asked for them
    num_prompt_tokens: int
    # With sampling.prompt_logprobs, on the output of token 0: entry i is prompt token i + 1's.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # Where the prompt was first computed from (Request.first_start). A request whose prompt takes more than a
    # step gets an output with no token and no finish reason when it starts: only this is news in it.
    first_start: int | None = None


def step_output(request: Request, token_index: int, token: SampledToken | None, reason: FinishReason | None,
                prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> StepOutput:
    """The request's output; takes the text it has not sent yet (all of it once `reason` is set)."""
    return StepOutput(
        request_id=request.request_id,
        token_index=token_index,
        new_token_ids=() if token is None else (token.token_id,),
        text=request.text.take_delta(is_final=reason is not None),
        finish_reason=reason,
        logprobs=None if token is None or token.logprob is None else (token.logprob,),
        num_prompt_tokens=request.num_prompt_tokens,
        prompt_logprobs=prompt_logprobs,
        first_start=request.first_start,
    )
