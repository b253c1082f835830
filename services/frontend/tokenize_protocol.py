"""vLLM's `/tokenize` and `/detokenize` bodies → validated requests (no tokenizer here).

    POST /tokenize   {"prompt": "text", "add_special_tokens": true}  or  {"messages": [...]}
                     → {"count": N, "max_model_len": L, "tokens": [...]}
    POST /detokenize {"tokens": [...]} → {"prompt": "text"}

`model` is optional in both and must name the served model when given. Bad bodies raise
`RequestError` (HTTP 400) naming the field, as the generation endpoints do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.frontend.chat_messages import ChatTemplateOptions, chat_messages, chat_template_options
from services.frontend.openai_protocol import RequestError, check_model
from services.frontend.request_error import json_type
from services.frontend.sampling_fields import is_int, opt_bool

MAX_DETOKENIZE_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    text: str | None  # the prompt, or None for messages
    messages: tuple[dict[str, Any], ...] | None  # rendered through the chat template
    add_special_tokens: bool = True  # prompt only (a chat template writes its own)
    chat_template: ChatTemplateOptions = ChatTemplateOptions()  # messages only


def parse_tokenize_request(body: Mapping[str, Any], served_model: str) -> TokenizeRequest:
    check_model(body, served_model)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("give exactly one of prompt (a string) and messages (a chat)",
                           param="messages" if has_messages else "prompt")
    add_special_tokens = opt_bool(body, "add_special_tokens")
    if has_messages:
        return TokenizeRequest(None, chat_messages(body), add_special_tokens=False,
                               chat_template=chat_template_options(body))
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt: expected a non-empty string", param="prompt")
    return TokenizeRequest(prompt, None, add_special_tokens=True if add_special_tokens is None else add_special_tokens)


def parse_detokenize_request(body: Mapping[str, Any], served_model: str) -> list[int]:
    check_model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise RequestError(f"tokens: required, a list of token ids (integers), got {json_type(tokens)}", param="tokens")
    bad = next((i for i, t in enumerate(tokens) if not is_int(t)), None)
    if bad is not None:
        raise RequestError(f"tokens[{bad}]: expected a token id (an integer), got {json_type(tokens[bad])}",
                           param=f"tokens[{bad}]")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise RequestError(f"tokens: at most {MAX_DETOKENIZE_TOKENS}, got {len(tokens)}", param="tokens")
    return tokens
