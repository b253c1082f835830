"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) for any answer that is an error."""

from __future__ import annotations

from typing import Any

from services.common.errors import FerryError
from services.frontend.request_error import named_path


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
