"""`RequestError`: a bad request body, HTTP 400 with the OpenAI error shape, its `param` the
field the message names."""

from __future__ import annotations

import json
import re
from typing import Any

from services.common.errors import InvalidArgument


class RequestError(InvalidArgument):
    """A bad request body: HTTP 400 with the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, request_id: str = "") -> None:
        super().__init__(message, request_id)
        self.param = named_path(message, param)
        self.code = code


_LEADING_FIELD = re.compile(r"([A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*): ")  # `messages[0].content[1]: ...`


def named_path(message: str, param: str | None) -> str | None:
    """The field a message starts with (`prompt[1]: ...`) where it is `param` or a part of it, so
    `param` is as exact as the message; else `param`."""
    match = _LEADING_FIELD.match(message)
    if match is None:
        return param
    path = match.group(1)
    if param is None or path == param or path.startswith((f"{param}[", f"{param}.")):
        return path
    return param


def json_text(text: str, param: str) -> Any:
    """`text` parsed as JSON; a 400 naming `param` where it is not JSON, or nests deeper than the parser recurses."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RequestError(f"{param}: not valid JSON: {exc}", param=param) from None
    except RecursionError:
        raise RequestError(f"{param}: the JSON nests too deeply", param=param) from None


def json_type(value: Any) -> str:
    """A JSON value's type as an error message shows what it got: "null", "number 3", "an array"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def shown(value: Any) -> str:
    """A value as an error message shows what it got: a short string quoted, a long or empty one by its
    length, anything else by its JSON type (json_type)."""
    if isinstance(value, str):
        return f"{len(value)} characters" if len(value) > 40 or not value else repr(value)
    return json_type(value)
