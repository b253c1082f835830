"""The tool fields of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and the
tool calls and results in its messages, checked and put in the shape chat templates take
(transformers' `apply_chat_template(..., tools=...)`, as vLLM passes them).

`tool_choice` `"auto"` (the default with tools) lets the model answer in text or call
tools, which the frontend parses from its answer (tool_calls.py); `"none"` shows the tools
and parses nothing. `"required"` and a named function need constrained decoding to force a
call, which ferry lacks: they are refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.frontend.request_error import RequestError

MAX_TOOLS = 128
MAX_TOOL_CALLS_IN_MESSAGE = 128


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks of tools."""

    parses_calls: bool = False  # tools with tool_choice "auto": the answer's tool calls are parsed
    max_calls: int | None = None  # parallel_tool_calls false: 1


def tool_use(body: Mapping[str, Any]) -> ToolUse:
    """Check `tools`, `tool_choice` and `parallel_tool_calls` of a chat request."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    _check_no_functions_nor_lone_choice(body)
    if not tools:
        return ToolUse()
    checked_tools(tools)
    if choice in ("required",) or isinstance(choice, dict):
        raise RequestError("tool_choice: \"required\" and a named function need constrained decoding to force a call, "
                    "which ferry lacks; use \"auto\" (the model decides) or \"none\"", param="tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice: expected \"auto\" or \"none\", got {str(choice)[:40]!r}", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls: expected true or false", param="parallel_tool_calls")
    return ToolUse(parses_calls=choice != "none", max_calls=1 if parallel is False else None)


def refuse_tool_calls(body: Mapping[str, Any]) -> None:
    """Completions: tools shown with tool_choice "none" are let through (and unused); calls are chat's."""
    _check_no_functions_nor_lone_choice(body)
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
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
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                        param=f"tools[{i}]")
    return tools


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
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{param}: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": "
                    "...}}", param=param)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends a JSON string; templates render an object (vLLM's rule)
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"{param}.function.arguments: not valid JSON", param=f"{param}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{param}.function.arguments: expected a JSON object", param=f"{param}.function.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
