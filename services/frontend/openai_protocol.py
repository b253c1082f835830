"""OpenAI request bodies → validated `ParsedRequest`s, with OpenAI-style error bodies.

No sockets and no tokenizer here: the server tokenizes the prompt, then calls
`resolve_max_tokens` and `check_prompt_token_ids`. Every problem with the input raises
`RequestError` (HTTP 400) whose message names the field; nothing here may raise anything
else for a bad body.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import FerryError, NotFound
from services.frontend import sampling_fields as fields
from services.frontend.chat_messages import ChatTemplateOptions, chat_messages, chat_template_options
from services.frontend.generation import Sampling
from services.frontend.request_error import RequestError, named_path
from services.frontend.request_error import json_type as _json_type
from services.frontend.request_error import shown
from services.frontend.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from services.frontend.sampling_fields import MAX_TOP_LOGPROBS, opt_bool
from services.frontend.structured_output import OutputConstraint, output_constraint
from services.frontend.tool_protocol import (ToolChoice, ToolUse, refuse_tool_calls,
                                             tool_use)

MAX_CHOICES = 16  # most `n`: each choice is a request of its own
MAX_PROMPTS = 64  # most prompts in one completions request (a batch)
MAX_BATCH_CHOICES = 128  # most prompts × n in one request
_OUTPUT_FLAGS = {"include_stop_str_in_output": False, "skip_special_tokens": True, "use_beam_search": False}
_UNSUPPORTED_SAMPLING = ("bad_words", "allowed_token_ids")  # vLLM's, refused unless empty
_REFUSED_FIELDS = {  # vLLM's, which change what is served: refused rather than ignored
    "chat_template": "a request's own chat template is not run (the model's is; vLLM takes one only with "
                     "--trust-request-chat-template)",
    "logits_processors": "logits processors are not run",
    "prompt_embeds": "prompts are taken as text or token ids, not embeddings",
    "guided_whitespace_pattern": "constrained JSON is written with one fixed whitespace (\", \" and \": \")",
}


Prompt = str | tuple[int, ...]  # text or token ids


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat.completions"


class ModelNotFound(NotFound):
    """A model name this server does not serve: HTTP 404 `model_not_found`, as OpenAI and vLLM answer."""

    code = "model_not_found"
    param = "model"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    prompts: tuple[Prompt, ...]  # completions: one or more (a batch); chat: none
    messages: tuple[dict[str, Any], ...] | None  # chat: role + text content
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    return_token_ids: bool = False  # ferry extension: choices and chunks carry token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    priority: int = 0  # ferry extension: higher runs first when the cache is short
    num_top_logprobs: int | None = None  # None = no logprobs; n = chosen token + top n
    n: int = 1  # choices per prompt: n requests of it (seeds seed, seed + 1, ... when one is given)
    chat_template: ChatTemplateOptions = ChatTemplateOptions()  # chat: how the messages are rendered
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last k tokens (-1: the context)
    add_special_tokens: bool = True  # vLLM's, completions: the tokenizer's BOS etc. around a text prompt
    echo: bool = False  # completions: each choice's text starts with its prompt (with logprobs: and its logprobs)
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt alone (one token runs, unseen)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs in its shape (token id -> logprob, rank)
    max_tokens_field: str = "max_tokens"  # chat: "max_completion_tokens" where that gave it (errors name it)
    max_tokens_is_default: bool = False  # completions without max_tokens: OpenAI's default 16 (errors say so)
    default_max_tokens: int | None = None  # chat without max_tokens: the model's max_new_tokens, else the context
    tool_use: ToolUse = ToolUse()  # chat: whether the answer's tool calls are parsed, and forced
    constraint: OutputConstraint | None = None  # structured output (response_format, guided_*): what the answer is

    @property
    def needs_grammar(self) -> bool:
        """Its decoding is constrained (structured output, forced tool calls): the served model
        builds the grammar (ServedModel.constrained), which takes the tool-call format."""
        return self.constraint is not None or self.tool_use.is_forced

    @property
    def constraint_field(self) -> str:
        """The request field that constrains its decoding (a metrics label): tool_choice for forced calls."""
        if self.tool_use.is_forced:
            return "tool_choice"
        return self.constraint.param.split(".")[0] if self.constraint is not None else ""

    @property
    def num_prompts(self) -> int:
        return max(1, len(self.prompts))  # chat: its messages make one prompt

    @property
    def num_choices(self) -> int:
        """Every answer the request asks for: prompt i's choice j is choice i * n + j."""
        return self.num_prompts * self.n

    @property
    def is_batch(self) -> bool:
        return len(self.prompts) > 1


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_ERROR_TYPE_BY_STATUS = {401: "invalid_request_error", 403: "invalid_request_error", 404: "invalid_request_error",
                         409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body_for(error: FerryError) -> dict[str, Any]:
    """The OpenAI error body of any ferry error (400s keep their param and code; a 400 from an
    instance names its field as the message's `field: ...` prefix)."""
    status = error.http_status
    type_ = _ERROR_TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    param = getattr(error, "param", None)
    if param is None and status == 400:
        param = named_path(error.message, None)
    return error_body(error.message, type_=type_, param=param, code=getattr(error, "code", None))


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        if "integer string conversion" in str(exc):  # Python's int() guard, whose message names sys.*
            raise RequestError(f"the request body holds an integer longer than {sys.get_int_max_str_digits()} "
                               "digits", code="invalid_json") from None
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    if _MAYBE_SURROGATE.search(raw) and (path := _lone_surrogate_path(body)) is not None:
        raise RequestError(f"{path}: contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape not part of a "
                           "pair), which is not text; send well-formed Unicode", param=path, code="invalid_text")
    return body


# JSON's \ud800-\udfff escapes, or their raw bytes (json.loads lets both through as surrogates).
_MAYBE_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _is_text(value: str) -> bool:
    """False for a string holding a lone surrogate (UTF-8, and so protobuf, cannot encode it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate_path(body: Any) -> str | None:
    """Where in a parsed body the first string holding a lone surrogate is (`stop[0]`,
    `messages[1].content`), or None. Walks with a stack of its own: json.loads takes bodies
    nested deeper than Python's recursion limit allows recursing through."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "(body)"
        elif isinstance(value, dict):
            if not all(_is_text(key) for key in value):  # a bad key: name the object holding it
                return path or "(body)"
            stack.extend(reversed([(item, f"{path}.{key}" if path else key) for key, item in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)]))
    return None


def parse_completion_request(body: Mapping[str, Any], served_model: str,
                             defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """`defaults`: the model's sampling defaults (its generation config) for fields the body leaves
    out; completions keep OpenAI's 16 for max_tokens, as vLLM does."""
    _reject_unsupported(body, Endpoint.COMPLETIONS)
    body = defaults.filled(body)
    logprobs = fields.opt_int(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    echo = opt_bool(body, "echo") or False
    max_tokens = _completion_max_tokens(body, echo)
    parsed = _parsed(body, served_model, Endpoint.COMPLETIONS, prompts=_prompts(body), messages=None,
                     max_tokens=max_tokens, default_max_tokens=16, num_top_logprobs=logprobs)
    if echo and logprobs is not None:  # the prompt's logprobs come first (the engine computes them in its prefill)
        wanted = max(logprobs, parsed.prompt_logprobs or 0)  # one engine ask serves echo and vLLM's prompt_logprobs
        parsed = replace(parsed, sampling=replace(parsed.sampling, num_prompt_logprobs=wanted))
    add_special_tokens = opt_bool(body, "add_special_tokens")
    return replace(parsed, echo=echo, echo_only=max_tokens == 0, add_special_tokens=add_special_tokens is not False,
                   constraint=output_constraint(body))


def _completion_max_tokens(body: Mapping[str, Any], echo: bool) -> int | None:
    max_tokens = fields.opt_int(body, "max_tokens", low=0)
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens: must be at least 1; 0 only with echo=true (the prompt alone, e.g. to score "
                           "it with logprobs)", param="max_tokens")
    return max_tokens


def parse_chat_request(body: Mapping[str, Any], served_model: str,
                       defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """`defaults`: the model's sampling defaults (its generation config) for fields the body leaves
    out, its max_new_tokens the max_tokens of a request without one (at most what the context leaves)."""
    _reject_unsupported(body, Endpoint.CHAT)
    body = defaults.filled(body)
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = fields.opt_int(body, max_tokens_field, low=1)
    fields.opt_int(body, "max_tokens", low=1)  # the deprecated field is still checked where the new one wins
    parsed = _parsed(body, served_model, Endpoint.CHAT, prompts=(), messages=chat_messages(body),
                     max_tokens=max_tokens, default_max_tokens=None, num_top_logprobs=_chat_logprobs(body),
                     max_tokens_field=max_tokens_field)
    if opt_bool(body, "add_special_tokens"):
        raise RequestError("add_special_tokens: the chat template writes the special tokens; leave it out or false",
                           param="add_special_tokens")
    tools, constraint = tool_use(body), output_constraint(body)
    _check_constraint_with_tools(constraint, tools)
    return replace(parsed, chat_template=chat_template_options(body), tool_use=tools, constraint=constraint,
                   default_max_tokens=defaults.max_tokens)


def _check_constraint_with_tools(constraint: OutputConstraint | None, tools: ToolUse) -> None:
    """A forced tool call is a constraint of its own: with another, a 400 naming both. With
    tool_choice auto, a JSON constraint leaves the model its choice (tool calls, or the answer
    in that JSON: tool_grammar.py); a regex, choice or grammar would rule calls out: a 400."""
    if constraint is None or not tools.parses_calls:
        return
    if tools.is_forced:
        forced = "\"required\"" if tools.choice is ToolChoice.REQUIRED else "naming a function"
        raise RequestError(f"{constraint.param}: cannot be combined with tool_choice {forced}, which constrains the "
                           "answer to tool calls; leave one of them out", param=constraint.param)
    if not constraint.is_json:
        raise RequestError(f"{constraint.param}: cannot be combined with tools under tool_choice \"auto\" (the "
                           "answer could not be a tool call); set tool_choice to \"none\" or leave it out",
                           param=constraint.param)


def resolve_max_tokens(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int,
                       prompt_index: int = 0) -> ParsedRequest:
    """Fix max_tokens against the context: the rest of it by default, 400 if the request can't fit.
    A 400 names the field to change, first in its message and as its param (as OpenAI's does): the
    prompt (`prompt`, `prompt[i]` of a batch, `messages`) where it leaves no room for any output,
    else max_tokens (or max_completion_tokens, where that gave it) or min_tokens."""
    room = max_model_len - num_prompt_tokens
    prompt = _prompt_field(parsed, prompt_index)
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


def _prompt_field(parsed: ParsedRequest, prompt_index: int) -> str:
    """The request field that holds prompt `prompt_index`."""
    if parsed.endpoint is Endpoint.CHAT:
        return "messages"
    return f"prompt[{prompt_index}]" if parsed.is_batch else "prompt"


def _prompt_noun(parsed: ParsedRequest) -> str:
    return "the chat template makes the messages" if parsed.endpoint is Endpoint.CHAT else "the prompt is"


def _check_min_tokens(min_tokens: int, max_tokens: int | None, field: str, is_default: bool) -> None:
    """min_tokens against a max_tokens known before the prompt is (a chat's default waits for it: resolve_max_tokens)."""
    if max_tokens is not None and min_tokens > max_tokens:
        default = ", the default of completions" if is_default else ""
        raise RequestError(f"min_tokens: {min_tokens} is more than {field} ({max_tokens}{default}); lower it"
                           f"{f' or set {field}' if is_default else ''}", param="min_tokens")


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


def _parsed(body: Mapping[str, Any], served_model: str, endpoint: Endpoint, *, prompts, messages,
            max_tokens: int | None, default_max_tokens: int | None, num_top_logprobs: int | None,
            max_tokens_field: str = "max_tokens") -> ParsedRequest:
    """`max_tokens`: the request's (0: a completions echo of the prompt alone, which runs one token, unseen)."""
    stream = opt_bool(body, "stream") or False
    output_tokens = max_tokens if max_tokens is not None else default_max_tokens
    if body.get("user") is not None and not isinstance(body["user"], str):  # OpenAI's end-user id: unused here
        raise RequestError(f"user: expected a string, got {_json_type(body['user'])}", param="user")
    sampling = fields.sampling(body, output_tokens, num_top_logprobs, stream)
    parsed = ParsedRequest(
        endpoint=endpoint, model=check_model(body, served_model), prompts=prompts, messages=messages,
        sampling=sampling, stream=stream, include_usage=_include_usage(body, stream),
        return_token_ids=opt_bool(body, "return_token_ids") or False,
        tokens_as_ids=opt_bool(body, "return_tokens_as_token_ids") or False,
        priority=fields.opt_int(body, "priority", low=-fields.INT32_MAX, high=fields.INT32_MAX) or 0,
        num_top_logprobs=num_top_logprobs, n=fields.opt_int(body, "n", low=1, high=MAX_CHOICES) or 1,
        truncate_prompt_tokens=fields.truncate_prompt_tokens(body), prompt_logprobs=sampling.num_prompt_logprobs,
        max_tokens_field=max_tokens_field, max_tokens_is_default=max_tokens is None and default_max_tokens is not None)
    _check_min_tokens(sampling.min_tokens, output_tokens, max_tokens_field, parsed.max_tokens_is_default)
    _check_num_choices(parsed)
    return parsed


def _check_num_choices(parsed: ParsedRequest) -> None:
    if parsed.num_choices > MAX_BATCH_CHOICES:
        raise RequestError(f"n: {parsed.n} choices for each of {parsed.num_prompts} prompts make "
                           f"{parsed.num_choices} answers; at most {MAX_BATCH_CHOICES} fit in one request", param="n")


def _reject_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    if endpoint is Endpoint.COMPLETIONS:
        best_of = fields.opt_int(body, "best_of", low=1)
        if best_of not in (None, 1):
            raise RequestError(f"best_of: only best_of=1 is supported, got {best_of}", param="best_of")
        if body.get("suffix") is not None:
            raise RequestError("suffix: not supported; leave it out", param="suffix")
        refuse_tool_calls(body)
    elif opt_bool(body, "echo"):  # vLLM's chat echo (the last message's text first) is not served
        raise RequestError("echo: not supported for chat completions (completions take it); leave it out",
                           param="echo")
    _reject_unserved_output(body)


def _reject_non_text_output(body: Mapping[str, Any]) -> None:
    """OpenAI's audio output: the model writes text only."""
    if body.get("audio") is not None:
        raise RequestError("audio: this model answers in text only; leave audio out", param="audio")
    modalities = body.get("modalities")
    if modalities is not None and not isinstance(modalities, list):
        raise RequestError(f"modalities: only [\"text\"] is supported, got {_json_type(modalities)}",
                           param="modalities")
    bad = next((i for i, m in enumerate(modalities or ()) if m != "text"), None)
    if bad is not None:
        raise RequestError(f"modalities[{bad}]: only [\"text\"] is supported, got {shown(modalities[bad])}",
                           param=f"modalities[{bad}]")


def _reject_unserved_output(body: Mapping[str, Any]) -> None:
    """Output options ferry would otherwise ignore are refused rather than answered without them."""
    _reject_non_text_output(body)
    for name in _UNSUPPORTED_SAMPLING:
        if body.get(name) not in (None, []):
            raise RequestError(f"{name}: not supported; leave it out", param=name)
    for name, why in _REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise RequestError(f"{name}: not supported: {why}; leave it out", param=name)
    for name, default in _OUTPUT_FLAGS.items():  # vLLM's output options; only their defaults are served
        if opt_bool(body, name) not in (None, default):
            raise RequestError(f"{name}: only {str(default).lower()} is supported; leave it out", param=name)


def check_model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:
        return served_model
    if not isinstance(model, str):
        raise RequestError(f"model: expected a string, got {_json_type(model)}", param="model")
    if model != served_model:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {served_model!r}")
    return model


def _prompts(body: Mapping[str, Any]) -> tuple[Prompt, ...]:
    """`prompt`: a string, a list of token ids, or a batch (a list of either)."""
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt: required (a string, a list of token ids, or a list of either)", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and not fields.is_int(prompt[0]):  # a batch (a token list starts with an id)
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}",
                               param="prompt")
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_one_prompt(prompt, "prompt"),)


def _one_prompt(prompt: Any, name: str) -> Prompt:
    if isinstance(prompt, (str, list)) and not prompt:
        raise RequestError(f"{name}: must not be empty", param=name)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if (bad := next((i for i, t in enumerate(prompt) if not fields.is_int(t)), None)) is not None:
            raise RequestError(f"{name}[{bad}]: expected a token id (an integer), got {_json_type(prompt[bad])}",
                               param=name)
        return tuple(prompt)
    raise RequestError(f"{name}: expected a string or a list of token ids (integers), got {_json_type(prompt)}",
                       param=name)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wants = opt_bool(body, "logprobs") or False
    top = fields.opt_int(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not wants:
        raise RequestError("top_logprobs: needs logprobs=true", param="top_logprobs")
    return (top or 0) if wants else None


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"stream_options: expected an object, got {_json_type(options)}", param="stream_options")
    if not stream:
        raise RequestError("stream_options: only allowed when stream is true", param="stream_options")
    if opt_bool(options, "continuous_usage_stats", param="stream_options.continuous_usage_stats"):
        raise RequestError("stream_options.continuous_usage_stats: not supported (usage comes once, in the last "
                           "chunk, with include_usage); leave it out", param="stream_options.continuous_usage_stats")
    return opt_bool(options, "include_usage", param="stream_options.include_usage") or False
