"""Structured output: the request fields that constrain what the model may write, turned into
one llguidance grammar for the engine (`Sampling.grammar`; the engine masks each step's
logits to the tokens it allows and finishes the request, stop, once it is complete).

The fields, at most one per request:

* OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}` (JSON that satisfies `schema`);
* vLLM's `guided_json` (a schema, or its JSON text), `guided_regex`, `guided_choice` (exactly
  one of a list of strings), `guided_grammar` (Lark, in llguidance's dialect), and its newer
  `structured_outputs` object holding one of `json`, `regex`, `choice`, `grammar`,
  `json_object`.

`output_constraint` reads the fields and builds the grammar without checking it (cheap, on
the event loop); `checked_grammar` has llguidance check it (up to a few hundred ms for a big
grammar: call it off the event loop). Forced tool calls are tool_grammar.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llguidance

from services.frontend.request_error import RequestError, json_text, json_type, shown

MAX_GRAMMAR_BYTES = 256 * 1024  # the instance refuses a longer grammar
MAX_GUIDED_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# JSON is written with one fixed whitespace: ", " between items, ": " after keys, no other
# whitespace (as json.dumps and most models write JSON inline). llguidance's default,
# whitespace_flexible true, allows any run of whitespace between tokens, where a small or
# unsure model can loop on spaces and newlines until max_tokens. These are overrides: a
# schema's own "x-guidance" options cannot turn flexible whitespace back on.
JSON_WHITESPACE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OUTPUTS_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a request's structured output field asks the answer to be."""

    param: str  # the field it came from ("response_format", "guided_regex", "structured_outputs.json"): errors name it
    grammar: str  # an llguidance grammar, not yet checked (checked_grammar)
    json_schema: str | None = None  # a JSON constraint's schema (JSON text): a tool-call grammar embeds it

    @property
    def is_json(self) -> bool:
        return self.json_schema is not None


def output_constraint(body: Mapping[str, Any]) -> OutputConstraint | None:
    """The one constraint `body` asks for, or None; a 400 naming both fields where it asks for two."""
    found = [c for c in (_response_format(body.get("response_format")), *_guided(body)) if c is not None]
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise RequestError(f"{second}: only one structured output constraint per request, and {first} is one "
                           f"already; send either {first} or {second}", param=second)
    return found[0] if found else None


def checked_grammar(grammar: str, param: str) -> str:
    """`grammar` if llguidance takes it; else a 400 naming `param` with llguidance's reason."""
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise RequestError(f"{param}: the grammar it makes is {size} bytes; at most {MAX_GRAMMAR_BYTES} are served "
                           "(send a smaller schema or grammar)", param=param)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError(f"{param}: not a valid constraint: {_first_lines(error)}", param=param)
    return grammar


def json_schema_grammar(schema: str, param: str) -> str:
    """The grammar of JSON satisfying `schema` (its JSON text), in ferry's whitespace (JSON_WHITESPACE)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_WHITESPACE)
    except ValueError as exc:  # not a JSON object (a check the schema's own nesting can fail)
        raise RequestError(f"{param}: not a valid JSON schema: {_first_lines(str(exc))}", param=param) from None


# ---- response_format -------------------------------------------------------------------


def _response_format(value: Any) -> OutputConstraint | None:
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_constraint(param, ANY_JSON_OBJECT)
    if kind == "json_schema":
        return _json_constraint(param, _openai_json_schema(value.get("json_schema")))
    if isinstance(value, dict):  # the type is what is wrong
        raise RequestError(f"{param}.type: expected \"text\", \"json_object\" or \"json_schema\", got {shown(kind)}",
                           param=f"{param}.type")
    raise RequestError(f"{param}: expected {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or {{\"type\": "
                       f"\"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, got "
                       f"{json_type(value)}", param=param)


def _openai_json_schema(value: Any) -> dict[str, Any]:
    param = "response_format.json_schema"
    if not isinstance(value, dict):
        raise RequestError(f"{param}: expected an object with name and schema, got {json_type(value)}", param=param)
    name = value.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise RequestError(f"{param}.name: required, 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                           f"{shown(name)}", param=f"{param}.name")
    for key, type_, kind in (("strict", bool, "true or false"), ("description", str, "a string")):
        if value.get(key) is not None and not isinstance(value[key], type_):
            raise RequestError(f"{param}.{key}: expected {kind}, got {json_type(value[key])}", param=f"{param}.{key}")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"{param}.schema: expected a JSON schema (an object), got {json_type(schema)}",
                           param=f"{param}.schema")
    return schema


# ---- vLLM's guided_* and structured_outputs ----------------------------------------------


def _guided(body: Mapping[str, Any]) -> list[OutputConstraint | None]:
    fields = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    found = [_guided_field(kind, name, body[name]) for kind, name in fields.items() if body.get(name) is not None]
    return [*found, _structured_outputs(body.get("structured_outputs"))]


def _structured_outputs(value: Any) -> OutputConstraint | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: expected an object with one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}, got "
                           f"{json_type(value)}", param=param)
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS) - set(_STRUCTURED_OUTPUTS_IGNORED))
    if unknown:
        raise RequestError(f"{param}.{unknown[0]}: not supported (ferry takes {', '.join(_STRUCTURED_OUTPUTS_KEYS)}); "
                           "leave it out", param=f"{param}.{unknown[0]}")
    kinds = [key for key in _STRUCTURED_OUTPUTS_KEYS if value.get(key) not in (None, False)]
    if len(kinds) != 1:
        raise RequestError(f"{param}: expected exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}, got "
                           f"{', '.join(kinds) or 'none'}", param=param)
    (kind,) = kinds
    if kind == "json_object":
        if value[kind] is not True:
            raise RequestError(f"{param}.json_object: expected true, got {json_type(value[kind])}",
                               param=f"{param}.json_object")
        return _json_constraint(f"{param}.json_object", ANY_JSON_OBJECT)
    return _guided_field(kind, f"{param}.{kind}", value[kind])


def _guided_field(kind: str, param: str, value: Any) -> OutputConstraint:
    if kind == "json":
        return _json_constraint(param, _schema_object(param, value))
    if kind == "choice":
        return OutputConstraint(param, _choice_grammar(param, value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param}: expected a non-empty string, got {shown(value)}", param=param)
    if kind == "regex":
        return OutputConstraint(param, llguidance.LLMatcher.grammar_from_regex(value))
    return OutputConstraint(param, llguidance.LLMatcher.grammar_from_lark(value))


def _schema_object(param: str, value: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        value = json_text(value, param)
    if not isinstance(value, dict):
        raise RequestError(f"{param}: expected a JSON schema (an object), got {json_type(value)}", param=param)
    return value


def _choice_grammar(param: str, value: Any) -> str:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_GUIDED_CHOICES:
        raise RequestError(f"{param}: expected a list of 1 to {MAX_GUIDED_CHOICES} strings, got "
                           f"{f'{len(value)} items' if isinstance(value, list) else json_type(value)}", param=param)
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not 1 <= len(choice) <= MAX_CHOICE_CHARS:
            raise RequestError(f"{param}[{i}]: expected a string of 1 to {MAX_CHOICE_CHARS} characters, got "
                               f"{shown(choice)}", param=param)
    # Lark string literals take JSON's escapes; the answer is exactly one of them
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def _json_constraint(param: str, schema: Mapping[str, Any]) -> OutputConstraint:
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise RequestError(f"{param}: the schema nests too deeply", param=param) from None
    return OutputConstraint(param, json_schema_grammar(text, param), text)


def _first_lines(error: str, limit: int = 600) -> str:
    """llguidance's reason, trimmed to what a client reads (its messages can quote the grammar)."""
    return error.strip()[:limit]
