"""OpenAI request bodies (completions, chat) → validated `ParsedRequest`s.

No sockets and no tokenizer here: the server reads the body (json_body.py), parses it here, tokenizes
the prompt, then checks it (prompt_checks.py: `resolve_max_tokens`, `check_prompt_token_ids`). Every
problem with the input raises `RequestError` (HTTP 400) whose message names the field; nothing here may
raise anything else for a bad body. Fields ferry does not serve are refused in unserved_fields.py;
error_bodies.py writes OpenAI's error body.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import NotFound
from services.frontend import sampling_fields as fields
from services.frontend.chat_messages import ChatTemplateOptions, chat_messages, chat_template_options
from services.frontend.generation import Sampling
from services.frontend.request_error import RequestError
from services.frontend.request_error import json_type as _json_type
from services.frontend.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from services.frontend.sampling_fields import MAX_TOP_LOGPROBS, opt_bool
from services.frontend.structured_output import OutputConstraint, output_constraint
from services.frontend.tool_protocol import ToolChoice, ToolUse, tool_use
from services.frontend.unserved_fields import reject_unserved_chat_fields, reject_unserved_completion_fields

MAX_CHOICES = 16  # most `n`: each choice is a request of its own
MAX_PROMPTS = 64  # most prompts in one completions request (a batch)
MAX_BATCH_CHOICES = 128  # most prompts × n in one request


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


def parse_completion_request(body: Mapping[str, Any], served_model: str,
                             defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """`defaults`: the model's sampling defaults (its generation config) for fields the body leaves
    out; completions keep OpenAI's 16 for max_tokens, as vLLM does."""
    reject_unserved_completion_fields(body)
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
    reject_unserved_chat_fields(body)
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


def _check_min_tokens(min_tokens: int, max_tokens: int | None, field: str, is_default: bool) -> None:
    """min_tokens against a max_tokens known before the prompt is (a chat's default waits for it: resolve_max_tokens)."""
    if max_tokens is not None and min_tokens > max_tokens:
        default = ", the default of completions" if is_default else ""
        raise RequestError(f"min_tokens: {min_tokens} is more than {field} ({max_tokens}{default}); lower it"
                           f"{f' or set {field}' if is_default else ''}", param="min_tokens")


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
