"""The tool fields of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and the
tool calls and results in its messages, checked and put in the shape chat templates take
(transformers' `apply_chat_template(..., tools=...)`, as vLLM passes them).

`tool_choice` `"auto"` (the default with tools) lets the model answer in text or call
tools, which the frontend parses from its answer (tool_calls.py); `"none"` shows the tools
and parses nothing. `"required"` (one or more calls of any tool) and a named function
(`{"type": "function", "function": {"name": ...}}`: a call of that one) force the answer to
be calls: a grammar in the model's tool-call format (tool_grammar.py) constrains its
decoding, and the calls are parsed as with "auto".
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.frontend.request_error import RequestError, json_text, json_type, shown

MAX_TOOLS = 128
MAX_TOOL_CALLS_IN_MESSAGE = 128
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a call's arguments: {}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool a call may name, as a tool-call grammar needs it."""

    index: int  # in `tools` (errors name tools[index])
    name: str
    parameters: str  # the JSON schema of its arguments, as JSON text


class ToolChoice(enum.Enum):
    NONE = "none"  # no tools, or tool_choice "none": the tools are shown, nothing is parsed
    AUTO = "auto"  # the model answers in text or calls tools
    REQUIRED = "required"  # one or more calls of any tool, nothing else
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}: one call of that tool, nothing else


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks of tools."""

    choice: ToolChoice = ToolChoice.NONE
    max_calls: int | None = None  # parallel_tool_calls false, or a named tool_choice: 1
    functions: tuple[FunctionTool, ...] = ()  # what a call may name: every tool, or a named tool_choice's one

    @property
    def parses_calls(self) -> bool:
        """The answer's tool calls are parsed (tool_calls.py)."""
        return self.choice is not ToolChoice.NONE

    @property
    def is_forced(self) -> bool:
        """The answer is tool calls and nothing else: a grammar forces them (tool_grammar.py)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)


def tool_use(body: Mapping[str, Any]) -> ToolUse:
    """Check `tools`, `tool_choice` and `parallel_tool_calls` of a chat request."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    _check_no_functions_nor_lone_choice(body)
    if tools is None or not checked_tools(tools):  # checked with any tool_choice: "none" shows them to the model
        return ToolUse()
    functions = _functions(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls: expected true or false", param="parallel_tool_calls")
    max_calls = 1 if parallel is False else None
    if isinstance(choice, dict):
        return ToolUse(ToolChoice.NAMED, 1, (_named(choice, functions),))
    if choice not in (None, "auto", "none", "required"):
        raise RequestError(f"tool_choice: expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {str(choice)[:40]!r}", param="tool_choice")
    return ToolUse(ToolChoice(choice or "auto"), max_calls, functions)


def _functions(tools: list[dict[str, Any]]) -> tuple[FunctionTool, ...]:
    functions = []
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS  # OpenAI: a function without parameters takes an empty list
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters: expected a JSON schema (an object)",
                               param=f"tools[{i}].function.parameters")
        try:
            functions.append(FunctionTool(i, tool["function"]["name"], json.dumps(parameters, ensure_ascii=False)))
        except RecursionError:
            raise RequestError(f"tools[{i}].function.parameters: the schema nests too deeply",
                               param=f"tools[{i}].function.parameters") from None
    return tuple(functions)


def _named(choice: dict[str, Any], functions: tuple[FunctionTool, ...]) -> FunctionTool:
    """tool_choice {"type": "function", "function": {"name": ...}}: the function it names."""
    name = _function_name(choice, "tool_choice")
    named = next((f for f in functions if f.name == name), None)
    if named is None:
        raise RequestError(f"tool_choice.function.name: no tool named {name[:64]!r} in tools (they are "
                           f"{', '.join(repr(f.name) for f in functions[:8])}{', ...' if len(functions) > 8 else ''})",
                           param="tool_choice.function.name")
    return named


def refuse_tool_calls(body: Mapping[str, Any]) -> None:
    """Completions: tools with tool_choice "none" are checked as chat's and let through (unused); calls are
    chat's."""
    if tool_use(body).parses_calls:
        raise RequestError("tools: tool calls are answered by chat completions (/v1/chat/completions); leave tools "
                           "out or set tool_choice to \"none\"", param="tools")


def _check_no_functions_nor_lone_choice(body: Mapping[str, Any]) -> None:
    if body.get("functions"):
        raise RequestError("functions: the deprecated function-call fields are not supported; send tools instead",
                           param="functions")
    if not body.get("tools") and body.get("tool_choice") not in (None, "none"):
        raise RequestError("tool_choice: only allowed with tools; leave it out or send tools", param="tool_choice")


def checked_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` as the chat template takes them, each a function with a name."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"tools: expected a list of at most {MAX_TOOLS} tools", param="tools")
    for i, tool in enumerate(tools):
        _function_name(tool, f"tools[{i}]")
    return tools


def _function_name(value: Any, param: str) -> str:
    """The name in `{"type": "function", "function": {"name": ...}}` (a tool, a tool_choice, a call in a message);
    "type" may be left out. An error names the field that is wrong (`tools[0].function.name`)."""
    if not isinstance(value, dict):
        raise RequestError(f"{param}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                           f"{json_type(value)}", param=param)
    if value.get("type", "function") != "function":
        raise RequestError(f"{param}.type: only \"function\" is supported, got {shown(value['type'])}",
                           param=f"{param}.type")
    function = value.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{param}.function: expected an object with a name, got {json_type(function)}",
                           param=f"{param}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"{param}.function.name: expected a non-empty string, got {shown(function.get('name'))}",
                           param=f"{param}.function.name")
    return function["name"]


def message_tool_fields(message: Mapping[str, Any], role: str, param: str) -> dict[str, Any]:
    """An assistant's `tool_calls` (arguments as objects, as templates expect them) and a tool
    result's `tool_call_id`, checked; {} where the message has neither."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise RequestError(f"{param}.tool_calls: only assistant messages carry tool calls", param=f"{param}.tool_calls")
        if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_IN_MESSAGE:
            raise RequestError(f"{param}.tool_calls: expected a list of at most {MAX_TOOL_CALLS_IN_MESSAGE} tool calls",
                        param=f"{param}.tool_calls")
        fields["tool_calls"] = [_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise RequestError(f"{param}.tool_call_id: expected a string", param=f"{param}.tool_call_id")
        fields["tool_call_id"] = call_id
    return fields


def _call(call: Any, param: str) -> dict[str, Any]:
    """A call as OpenAI writes it: `{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}`
    ("id" and "type" may be left out), its arguments a JSON object's text, which becomes the object
    templates render (vLLM's rule)."""
    name = _function_name(call, param)
    out = {"type": "function", "function": {"name": name, "arguments": _arguments(call["function"], param)}}
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise RequestError(f"{param}.id: expected a string, got {json_type(call_id)}", param=f"{param}.id")
    if call_id is not None:
        out["id"] = call_id
    return out


def _arguments(function: Mapping[str, Any], param: str) -> dict[str, Any]:
    param = f"{param}.function.arguments"
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise RequestError(f"{param}: expected a string (a JSON object's text, as OpenAI writes it), got "
                           f"{json_type(arguments)}", param=param)
    arguments = json_text(arguments, param) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise RequestError(f"{param}: expected a JSON object, got {json_type(arguments)}", param=param)
    return arguments
