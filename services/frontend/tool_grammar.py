"""The grammar that makes a model write tool calls: in the served model's tool-call format
(tool_calls.py), each call naming one of the request's tools, its arguments satisfying that
tool's `parameters` schema.

* tool_choice `"required"`: one or more calls of any tool (one where parallel_tool_calls is
  false); a named function: one call of it. Nothing else: no text before, between or after.
* tool_choice `"auto"` with a JSON `response_format` (or guided_json ...): calls as above, or
  the answer in that format. The model keeps its choice; only the shape of each is fixed.

Lark in llguidance's dialect, each call a `%json {...}` schema of the whole call object:

    start: call ("\n" call)*                       # hermes; llama3_json separates calls with "; "
    call: "<tool_call>" "\n" (fn0 | fn1) "\n" "</tool_call>"
                                                  # mistral: "[TOOL_CALLS]" " "? "[" call (", " call)* "]"
    fn0: %json {"type": "object", "properties": {"name": {"const": "get_weather"},
                "arguments": {...its parameters...}}, "required": ["name", "arguments"], ...}

Mistral's `name[ARGS]{...}` calls are `call: "[TOOL_CALLS]" (fn0 | fn1)` with
`fn0: "get_weather" "[ARGS]" %json {...its parameters...}`.

Keys come in the schema's order (name, then the arguments), as the formats show them, and
in ferry's JSON whitespace (structured_output.JSON_WHITESPACE). The parser reads the calls
out of the text as it does for "auto" (ToolCallParser).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.frontend.request_error import RequestError
from services.frontend.structured_output import (JSON_WHITESPACE, OutputConstraint, checked_grammar,
                                                json_schema_grammar)
from services.frontend.tool_calls import HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, ToolCallFormat
from services.frontend.tool_protocol import FunctionTool, ToolUse



@dataclass(frozen=True, slots=True)
class _Format:
    opening: tuple[str, ...]  # text before a call's JSON, in pieces (a tag is one)
    closing: tuple[str, ...]  # after it
    separator: str  # between two calls
    arguments_key: str  # the call object's key for the arguments
    before_calls: tuple[str, ...] = ()  # before the first call
    after_calls: tuple[str, ...] = ()  # after the last


_FORMATS = {
    ToolCallFormat.HERMES: _Format((HERMES_OPEN, "\n"), ("\n", HERMES_CLOSE), "\n", "arguments"),
    ToolCallFormat.LLAMA3_JSON: _Format((), (), "; ", "parameters"),
    ToolCallFormat.MISTRAL: _Format((), (), ", ", "arguments", (MISTRAL_CALLS,), ("]",)),
    ToolCallFormat.MISTRAL_ARGS: _Format((MISTRAL_CALLS,), (), "", "arguments"),
}


def tool_call_grammar(tool_use: ToolUse, format_: ToolCallFormat, answer: OutputConstraint | None = None,
                      tag_token_ids: Mapping[str, int] | None = None) -> str:
    """The checked grammar of `tool_use`'s calls in `format_` (or, with `answer`, a JSON
    constraint and tool_choice auto: those calls or that answer); a 400 naming the tool whose
    parameters llguidance refuses. `tag_token_ids`: the format's tags that the model's
    vocabulary holds as one token (Qwen's <tool_call>), which the grammar also takes by id."""
    spec, tags = _FORMATS[format_], tag_token_ids or {}
    if format_ is ToolCallFormat.MISTRAL_ARGS:
        functions = [_args_function_rule(function, tags) for function in tool_use.functions]
    else:
        functions = [f"%json {_checked_function_schema(function, spec.arguments_key)}" for function in tool_use.functions]
    opening, closing, before, after = (" ".join(_piece(p, tags) for p in pieces) for pieces in (
        spec.opening, spec.closing, spec.before_calls, spec.after_calls))
    one_call = f"{opening} ({' | '.join(f'fn{i}' for i in range(len(functions)))}) {closing}".strip()
    separator = f"{json.dumps(spec.separator)} " if spec.separator else ""  # mistral_args: calls follow each other
    calls = "call" if tool_use.max_calls == 1 else f"call ({separator}call)*"
    if format_ is ToolCallFormat.MISTRAL:  # "[" after the marker: sentencepiece models write " [", tekken ones "["
        before += ' " "? "["'
    calls = f"{before} {calls} {after}".strip()
    lines = [f"start: {calls} | answer" if answer is not None else f"start: {calls}", f"call: {one_call}"]
    lines += [f"fn{i}: {rule}" for i, rule in enumerate(functions)]
    if answer is not None and answer.json_schema is not None:
        lines.append(f"answer: %json {_with_whitespace(json.loads(answer.json_schema))}")
    param = answer.param if answer is not None else "tool_choice"
    return checked_grammar("\n".join(lines) + "\n", param)


def _piece(text: str, tag_token_ids: Mapping[str, int]) -> str:
    """Lark for `text`. A tag the vocabulary holds as one added token is also taken as that token
    by id: llguidance reads added tokens shaped <...> as special ones, which a text literal
    does not match (it would let the token through the mask and then refuse it)."""
    if text in tag_token_ids:
        return f"({json.dumps(text)} | <[{tag_token_ids[text]}]>)"
    return json.dumps(text)


def _args_function_rule(function: FunctionTool, tag_token_ids: Mapping[str, int]) -> str:
    """Mistral's `name[ARGS]{...}`: the name, the [ARGS] marker, JSON of the tool's parameters."""
    param = f"tools[{function.index}].function.parameters"
    schema = _with_whitespace(json.loads(function.parameters))
    checked_grammar(json_schema_grammar(schema, param), param)
    return f"{json.dumps(function.name)} {_piece(MISTRAL_ARGS, tag_token_ids)} %json {schema}"


def _checked_function_schema(function: FunctionTool, arguments_key: str) -> str:
    """The JSON schema of one whole call of `function` (JSON text), checked on its own so that a
    bad `parameters` is a 400 naming its tool."""
    param = f"tools[{function.index}].function.parameters"
    try:
        parameters = _rebased_refs(json.loads(function.parameters), f"#/properties/{arguments_key}")
    except RecursionError:  # two frames a level: a schema the request body could nest
        raise RequestError(f"{param}: the schema nests too deeply", param=param) from None
    call = {"type": "object", "properties": {"name": {"const": function.name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
    schema = _with_whitespace(call)
    checked_grammar(json_schema_grammar(schema, param), param)
    return schema


def _rebased_refs(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#", "#/$defs/X", "#/properties/a") pointing where the schema now sits,
    at `base` inside the call object (they were relative to the parameters' own root)."""
    if isinstance(schema, list):
        return [_rebased_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased_refs(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        rebased["$ref"] = base + ref[1:]
    return rebased


def _with_whitespace(schema: dict[str, Any]) -> str:
    """`schema` as JSON text, its llguidance options set to ferry's JSON whitespace."""
    options = schema.get("x-guidance")
    merged = {**options, **JSON_WHITESPACE} if isinstance(options, dict) else JSON_WHITESPACE
    return json.dumps({**schema, "x-guidance": merged}, ensure_ascii=False)
