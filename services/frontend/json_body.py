"""A request body as a JSON object, or a 400 (`invalid_json`, `invalid_text`) saying what is wrong with it."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from services.frontend.request_error import RequestError
from services.frontend.request_error import json_type as _json_type


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
