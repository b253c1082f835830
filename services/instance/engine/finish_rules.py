"""When a request stops, decided as each token is appended.

A request stops on a stop token id (its text is left out), on eos (unless `ignore_eos`), on a stop
string (the text ends before it), where its grammar is complete, at `max_tokens` (resumed tokens
included) or at the model's context (`max_model_len`). None of these count before it has `min_tokens`
tokens, save the length limits; until then its stop token ids and eos may not be sampled at all.
"""

from __future__ import annotations

from collections.abc import Set

from services.instance.engine.request import FinishReason, Request


def banned_token_ids(request: Request, eos_token_ids: Set[int]) -> tuple[int, ...]:
    """Tokens the next one may not be: its stop token ids and eos until it has min_tokens tokens."""
    sampling = request.sampling
    if request.num_output_tokens >= sampling.min_tokens:
        return ()
    eos = () if sampling.ignore_eos else tuple(eos_token_ids)
    return (*sampling.stop_token_ids, *eos)


def stop_reason(request: Request, token_id: int, eos_token_ids: Set[int], max_model_len: int) -> FinishReason | None:
    """Why the request stops now that `token_id` (already in its output) was sampled; None if it goes on.
    Appends the token's text to the request's (unless it is a stop token)."""
    reason = _token_stop_reason(request, token_id, eos_token_ids, max_model_len)
    if reason is FinishReason.LENGTH and request.text.finish():
        return FinishReason.STOP  # a stop string in the text held back to the end
    return reason


def reason_when_too_long(request: Request) -> FinishReason | None:
    """A request the scheduler ended for outgrowing the whole cache: LENGTH, unless a stop string in the
    text held back to the end cuts it (STOP), as at max_tokens."""
    return FinishReason.STOP if request.text.finish() else request.finish_reason


def _token_stop_reason(request: Request, token_id: int, eos_token_ids: Set[int],
                       max_model_len: int) -> FinishReason | None:
    sampling = request.sampling
    if request.num_output_tokens < sampling.min_tokens:
        request.text.append(token_id)  # the text grows; stop strings do not count yet (TextOutput)
        return _grammar_reason(request) or _length_reason(request, max_model_len)
    if token_id in sampling.stop_token_ids:
        return FinishReason.STOP  # its text is left out
    if token_id in eos_token_ids and not sampling.ignore_eos:
        return FinishReason.STOP
    if request.text.append(token_id):
        return FinishReason.STOP
    return _grammar_reason(request) or _length_reason(request, max_model_len)


def _grammar_reason(request: Request) -> FinishReason | None:
    """Stop where the request's grammar is complete (or broken: it can allow nothing more)."""
    guide = request.guide
    return FinishReason.STOP if guide is not None and (guide.is_complete or guide.error) else None


def _length_reason(request: Request, max_model_len: int) -> FinishReason | None:
    if request.num_output_tokens >= request.sampling.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
