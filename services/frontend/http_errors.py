"""Errors as HTTP answers: the error middleware turns a raised `FerryError` into its status
and OpenAI error body (with an `x-request-id`, request_ids.py, `WWW-Authenticate` on
a 401, `Retry-After` on a 429 or 503), aiohttp's own 404/405/413 into the same body, and
anything else (a bug) into a 500 without details, its traceback in the log. It counts every
answer in `ferry_frontend_requests_total`, a client gone as nginx's 499, and those aiohttp
makes itself, HTTP it cannot parse as endpoint `unparsable` (count_own_answer).

A request refused before it got its request id (a 400, 401, 404 model, 408, 413, 429 or
503) is logged as `request_refused` with the id made for its answer (request_ids.py), at most one
line per (route, status) per 10 s. HTTP that aiohttp cannot parse is answered before any route or
middleware (bad_http.py).
"""

from __future__ import annotations

import asyncio
import uuid

import structlog
from aiohttp import web

from services.common.errors import FerryError
from services.common.log_sampling import LogSampler
from services.frontend.cors import Handler
from services.frontend.metrics import FrontendMetrics
from services.frontend.error_bodies import error_body, error_body_for
from services.frontend.request_ids import HEADER as REQUEST_ID_HEADER
from services.frontend.request_ids import REQUEST_ID_KEY, answer_request_id, client_request_id

log = structlog.get_logger(__name__)

RETRY_AFTER_S = 1  # the Retry-After of 429s and 503s: load and membership change within seconds
UNPARSABLE = "unparsable"  # the endpoint label of aiohttp's 4xx answers to HTTP it could not parse (bad_http.py)
UNCAUGHT = "uncaught"  # ... and of its 5xx ones, to an error no middleware caught (none known)


class PayloadTooLarge(FerryError):
    """A body over --max-body-bytes (HTTP only: no gRPC row in the errors table)."""

    http_status = 413


class BodyTimeout(FerryError):
    """A body that did not arrive within --body-timeout-s (a slow or stalled client; HTTP only)."""

    http_status = 408


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit} bytes (--max-body-bytes)")


class ErrorAnswers:
    def __init__(self, metrics: FrontendMetrics) -> None:
        self._metrics = metrics
        self._refusal_log = LogSampler()  # request_refused: one line per (route, status) per 10 s at most

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except asyncio.CancelledError:  # the client went away: nginx's 499, so the request is still counted
            self._metrics.requests.labels(_endpoint_label(request), "499").inc()
            raise
        except FerryError as exc:
            _log_refused(request, exc, self._refusal_log)
            response = _error_response(request, exc.http_status, error_body_for(exc))
        except web.HTTPException as exc:  # the router's 404/405, aiohttp's own 413
            response = _error_response(request, exc.status, error_body(
                f"{exc.reason}: {request.method} {request.path}", code=exc.reason.lower().replace(" ", "_")))
            if "Allow" in exc.headers:  # a 405 names the methods the path takes
                response.headers["Allow"] = exc.headers["Allow"]
        except Exception:  # a bug: a 500 without details; the traceback goes to the log
            request.setdefault(REQUEST_ID_KEY, f"crash-{uuid.uuid4().hex}")  # it crashed before it got one
            log.exception("request_crashed", path=request.path, request_id=request[REQUEST_ID_KEY])
            response = _error_response(request, 500, error_body(
                "internal error; the server logged it under this request's x-request-id", type_="server_error"))
        self._metrics.requests.labels(_endpoint_label(request), str(response.status)).inc()
        return response

    def count_own_answer(self, status: int) -> None:
        """Count an answer aiohttp made itself (bad_http.py's ON_OWN_ANSWER), to HTTP no route saw: a
        refusal of HTTP it could not parse (`unparsable`), or a 5xx of an error no middleware caught."""
        self._metrics.requests.labels(UNPARSABLE if status < 500 else UNCAUGHT, str(status)).inc()


def _error_response(request: web.Request, status: int, body: dict) -> web.Response:
    headers = {REQUEST_ID_HEADER: answer_request_id(request)}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status in (429, 503):  # full, or nothing serves now: worth another try soon
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return web.json_response(body, status=status, headers=headers)


def _log_refused(request: web.Request, exc: FerryError, sampler: LogSampler) -> None:
    """A request answered with an error before it was admitted (a 400, 401, 404 model, 413, 429, ...):
    it has no request id yet, so no other line names it; one admitted has its `request_finished`. A flood
    of them logs one line per (route, status) per 10 s, with the number left out since (`suppressed`)."""
    if REQUEST_ID_KEY in request:
        return
    request_id = answer_request_id(request)  # the answer's x-request-id
    if (suppressed := sampler.admit((_endpoint_label(request), exc.http_status))) is not None:
        log.info("request_refused", path=request.path, status=exc.http_status, error=exc.message,
                 request_id=request_id, client_request_id=client_request_id(request.headers, {}),
                 suppressed=suppressed)


def _endpoint_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
