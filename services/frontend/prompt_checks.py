"""A tokenized prompt against what the model serves: its vocabulary (`check_prompt_token_ids`), its context
(`resolve_max_tokens` fixes max_tokens against it), and an instance's refusal of it (`in_client_terms`).

The server tokenizes the prompt (served_model.py), then calls these; each problem is a 400 naming the field
the client sent the prompt in: `prompt`, `prompt[i]` of a batch, or `messages`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TypeVar

from services.common.errors import FerryError, InvalidArgument
from services.frontend.openai_protocol import Endpoint, ParsedRequest
from services.instance.engine.context_window import OVER_CONTEXT  # no torch
from services.frontend.request_error import RequestError

T = TypeVar("T")

INSTANCE_PROMPT_FIELD = "prompt_token_ids"  # the prompt's field in the instance's GenerateRequest


def resolve_max_tokens(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int,
                       prompt_index: int = 0) -> ParsedRequest:
    """Fix max_tokens against the context: the rest of it by default, 400 if the request can't fit.
    A 400 names the field to change, first in its message and as its param (as OpenAI's does): the
    prompt (`prompt`, `prompt[i]` of a batch, `messages`) where it leaves no room for any output,
    else max_tokens (or max_completion_tokens, where that gave it) or min_tokens."""
    room = max_model_len - num_prompt_tokens
    prompt = prompt_field(parsed, prompt_index)
    if room <= 0:
        raise RequestError(
            f"{prompt}: {_prompt_noun(parsed)} {num_prompt_tokens} tokens, but this model's maximum context length "
            f"is {max_model_len} tokens (prompt and output together); shorten it",
            param=prompt, code="context_length_exceeded")
    max_tokens = parsed.sampling.max_tokens
    if max_tokens is None:  # chat without one: what the context leaves, or the model's default
        max_tokens = min(room, parsed.default_max_tokens or room)
        if parsed.sampling.min_tokens > max_tokens:
            source = "the model's default: max_new_tokens of its generation config" if max_tokens < room else \
                "what the context leaves"
            raise RequestError(f"min_tokens: {parsed.sampling.min_tokens} is more than max_tokens ({max_tokens}, "
                               f"{source}); lower it", param="min_tokens")
    elif max_tokens > room:
        field, is_default = parsed.max_tokens_field, parsed.max_tokens_is_default
        shown_prompt = prompt if parsed.is_batch else "the prompt"
        raise RequestError(
            f"{field}: this model's maximum context length is {max_model_len} tokens; you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in {shown_prompt}, {max_tokens} for the "
            f"output{', the default max_tokens' if is_default else ''}); {'set' if is_default else 'reduce'} "
            f"{field} to at most {room} or shorten {shown_prompt}",
            param=field, code="context_length_exceeded")
    return replace(parsed, sampling=replace(parsed.sampling, max_tokens=max_tokens))


def prompt_field(parsed: ParsedRequest, prompt_index: int) -> str:
    """The request field that holds prompt `prompt_index`."""
    if parsed.endpoint is Endpoint.CHAT:
        return "messages"
    return f"prompt[{prompt_index}]" if parsed.is_batch else "prompt"


def _prompt_noun(parsed: ParsedRequest) -> str:
    return "the chat template makes the messages" if parsed.endpoint is Endpoint.CHAT else "the prompt is"


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int, name: str = "prompt",
                           first_index: int | None = None) -> None:
    """`name`: the field the tokens came from ("prompt", "prompt[2]" in a batch, "messages"); `first_index`:
    see check_in_vocabulary."""
    if not token_ids:
        raise RequestError(f"{name}: the prompt is empty; send at least one token", param=name)
    check_in_vocabulary(token_ids, vocab_size, name, first_index)


def check_in_vocabulary(token_ids: Sequence[int], vocab_size: int, name: str, first_index: int | None = None) -> None:
    """`first_index`: where token_ids[0] is in the request's list `name`, so an error names the id's element
    (`prompt[5]`); None where the ids are not the request's own (encoded from text or a chat template)."""
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        path = name if first_index is None else f"{name}[{first_index + bad}]"
        raise RequestError(f"{path}: token id {token_ids[bad]} is outside the vocabulary [0, {vocab_size})",
                           param=path)


def in_client_terms(error: FerryError, parsed: ParsedRequest, prompt_index: int) -> FerryError:
    """An instance's 400 about the prompt names the client's field for it, not the instance's
    `prompt_token_ids`: the prompt can be too long for an instance serving a shorter context than the
    least this frontend knew of when it checked (resolve_max_tokens), one that registered meanwhile.
    It has the param and code the frontend's own check gives (`context_length_exceeded` for a prompt over
    the context, as OpenAI's)."""
    prefix = f"{INSTANCE_PROMPT_FIELD}: "
    if not isinstance(error, InvalidArgument) or not error.message.startswith(prefix):
        return error
    field = prompt_field(parsed, prompt_index)
    code = "context_length_exceeded" if OVER_CONTEXT in error.message else None
    return RequestError(f"{field}: {error.message[len(prefix):]}", param=field, code=code, request_id=error.request_id)


async def prompt_errors_in_client_terms(items: AsyncIterator[T], parsed: ParsedRequest,
                                        prompt_index: int) -> AsyncIterator[T]:
    """`items` (a choice's deltas), whose error, if any, is raised `in_client_terms`."""
    try:
        async for item in items:
            yield item
    except InvalidArgument as exc:
        renamed = in_client_terms(exc, parsed, prompt_index)
        if renamed is exc:
            raise
        raise renamed from exc
