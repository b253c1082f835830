"""Request ids: ferry's own, built on the one a client sends where it sends one.

A client (or a proxy in front of ferry) may name a request with an `X-Request-Id` header or
vLLM's `request_id` body field; the header wins, as in vLLM. ferry's id is then
`<prefix>-<client id>-<12 hex>`: the client's id can be found in every service's log, the
admin API's requests and the response's `id`, and the random tail keeps ferry's ids unique
(every service keys a request by its id, and a client's retry under the same id may meet
its first try still aborting on an instance). Without one it is `<prefix>-<32 hex>`.

The id travels as gRPC metadata and in log lines, so it is made of visible ASCII: any other
character becomes `_`, and it is cut to 128 characters. A proxy's ids are never a reason to
refuse a request (an empty one is as none); only a body `request_id` that is not a string is.

Every answer carries an `x-request-id`: a generation's is its request's id; any other answer (a refusal
before a request was created, /health, /v1/models, HTTP that could not be parsed, ...) gets one made
for it, `req-...` on the same rule, so a client can quote any answer's id and find its log line.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from services.frontend.generation import RequestId
from services.frontend.request_error import RequestError

HEADER = "x-request-id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)  # ferry's id, on an HTTP request once it has one
ANSWER_PREFIX = "req"  # of the id an answer gets where no request was created
BODY_FIELD = "request_id"
MAX_CLIENT_ID_CHARS = 128
_NOT_VISIBLE_ASCII = re.compile(r"[^\x21-\x7e]")


def client_request_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The id the client named its request with (the header's, else the body's), made safe; None if none."""
    value = headers.get(HEADER)
    if not value:
        value = body.get(BODY_FIELD)
        if value is not None and not isinstance(value, str):
            raise RequestError(f"{BODY_FIELD}: must be a string", BODY_FIELD)
    return _NOT_VISIBLE_ASCII.sub("_", value[:MAX_CLIENT_ID_CHARS]) if value else None


def new_request_id(prefix: str, client_id: str | None) -> RequestId:
    if client_id is None:
        return RequestId(f"{prefix}-{uuid.uuid4().hex}")
    return RequestId(f"{prefix}-{client_id}-{uuid.uuid4().hex[:12]}")


def answer_request_id(request: web.BaseRequest) -> str:
    """The id an answer to `request` carries: its request's, else one made now (and kept on it) from
    the client's header, as a request's would be."""
    if (request_id := request.get(REQUEST_ID_KEY)) is None:
        request_id = request[REQUEST_ID_KEY] = new_request_id(ANSWER_PREFIX, client_request_id(request.headers, {}))
    return request_id


async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer the app gives carries an x-request-id."""
    if HEADER not in response.headers:
        response.headers[HEADER] = answer_request_id(request)
