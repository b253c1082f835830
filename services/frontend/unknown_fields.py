"""Top-level request fields the frontend does not know: ignored, said so, or (--reject-unknown-fields) refused.

OpenAI answers an unknown field with a 400 "Unrecognized request argument supplied: X". vLLM accepts and
ignores it, logging a warning per request: it refused them once (pydantic's extra="forbid") and clients broke,
since they send fields of their own or of other servers (vLLM PR 10463: CodeCompanion's, DSPy's), and the
OpenAI SDK sends `extra_body` fields at the top level. So by default an unknown field is ignored, as vLLM
does, and said so where someone looks: the answer's `x-ferry-ignored-fields` header names it, and the
frontend logs `unknown_request_fields` at warning once per field name (with the known field it is nearest
to: `max_token` is most likely `max_tokens`, whose absence gives the client a long answer).
`--reject-unknown-fields` answers as OpenAI does instead, a 400 naming the field.

Known: every field the request parsers read (a unit test runs them on a recording body and compares), and
the few OpenAI fields that only tag a request (`store`, `metadata`, ...) and change nothing in the answer.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web

from services.frontend.openai_protocol import Endpoint
from services.frontend.request_error import RequestError

log = structlog.get_logger(__name__)

HEADER = "x-ferry-ignored-fields"
IGNORED_FIELDS_KEY = web.RequestKey("ignored_fields", list)  # on an HTTP request whose answer ignores some
MAX_NAME_CHARS = 64  # of a field name in the header and the log (a client picks its names)
MAX_NAMES_SHOWN = 16  # in the header and a 400's message; more end with ", ..."
MAX_NAMES_LOGGED = 256  # names logged once each; past it, new names are no longer logged (one line says so)

_BOTH = frozenset({
    # OpenAI's
    "model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "max_tokens", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "seed", "user", "response_format", "tools", "tool_choice",
    "functions", "audio", "modalities", "echo",
    # ferry's and vLLM's (README "Request fields"; the refused ones, README "Refused fields")
    "return_token_ids", "ignore_eos", "priority", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
    "min_tokens", "prompt_logprobs", "truncate_prompt_tokens", "add_special_tokens", "cache_salt",
    "return_tokens_as_token_ids", "request_id", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_whitespace_pattern", "include_stop_str_in_output",
    "skip_special_tokens", "use_beam_search", "bad_words", "allowed_token_ids", "chat_template",
    "logits_processors", "prompt_embeds",
    # OpenAI's that only tag or route a request: accepted, nothing in the answer changes
    "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
})
KNOWN_FIELDS = {
    Endpoint.COMPLETIONS: _BOTH | {"prompt", "best_of", "suffix"},
    Endpoint.CHAT: _BOTH | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
                            "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "prediction"},
}
_NOT_VISIBLE_ASCII = re.compile(r"[^\x21-\x7e]")


def unknown_fields(body: Mapping[str, Any], endpoint: Endpoint) -> list[str]:
    """The body's top-level fields `endpoint` does not know, sorted."""
    return sorted(name for name in body if name not in KNOWN_FIELDS[endpoint])


def nearest_known(name: str, endpoint: Endpoint) -> str | None:
    """The known field `name` most likely misspells (`max_token` -> `max_tokens`), if one is close."""
    matches = difflib.get_close_matches(name, KNOWN_FIELDS[endpoint], n=1, cutoff=0.8)
    return matches[0] if matches else None


def shown_names(names: list[str]) -> str:
    """Names as a header value or a message shows them: visible ASCII, each cut short, at most MAX_NAMES_SHOWN."""
    shown = [_NOT_VISIBLE_ASCII.sub("_", name[:MAX_NAME_CHARS]) or "_" for name in names[:MAX_NAMES_SHOWN]]
    return ", ".join(shown + (["..."] if len(names) > MAX_NAMES_SHOWN else []))


class UnknownFieldPolicy:
    """What the frontend does with unknown fields: refuse them (`is_strict`), or ignore them, logging each
    field name once."""

    def __init__(self, is_strict: bool = False) -> None:
        self.is_strict = is_strict
        self._logged: set[tuple[Endpoint, str]] = set()

    def check(self, body: Mapping[str, Any], endpoint: Endpoint) -> list[str]:
        """The unknown fields the answer ignores (its header names them); a 400 for them where strict."""
        names = unknown_fields(body, endpoint)
        if names and self.is_strict:
            raise _refusal(names, endpoint)
        for name in names:
            self._log_once(name, endpoint)
        return names

    def _log_once(self, name: str, endpoint: Endpoint) -> None:
        key = (endpoint, name[:MAX_NAME_CHARS])
        if key in self._logged or len(self._logged) > MAX_NAMES_LOGGED:
            return
        self._logged.add(key)
        if len(self._logged) > MAX_NAMES_LOGGED:
            log.warning("unknown_request_fields_not_logged", num_logged=MAX_NAMES_LOGGED,
                        hint="so many unknown field names came that new ones are no longer logged; the "
                             f"{HEADER} header still names them")
            return
        log.warning("unknown_request_fields", field=shown_names([name]), endpoint=endpoint.value,
                    did_you_mean=nearest_known(name, endpoint),
                    hint=f"ignored (its answer's {HEADER} header names it); logged once per field name; "
                         "--reject-unknown-fields refuses such requests with a 400")


async def stamp_ignored_fields(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the answer to a request with unknown fields names them (HEADER)."""
    if names := request.get(IGNORED_FIELDS_KEY):
        response.headers[HEADER] = shown_names(names)


def _refusal(names: list[str], endpoint: Endpoint) -> RequestError:
    nearest = nearest_known(names[0], endpoint)
    hint = f" (did you mean {nearest}?)" if nearest else ""
    return RequestError(f"Unrecognized request argument supplied: {shown_names(names)}{hint}; this server runs "
                        "with --reject-unknown-fields", param=shown_names(names[:1]))
