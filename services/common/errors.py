"""ferry's error table in one place: an exception per row, its gRPC status, HTTP status and
what the caller should do.

Servers raise a `FerryError` subclass; `ErrorInterceptor` turns it into the status code.
Clients map an `AioRpcError` back with `error_from_rpc`. Messages say how to fix the
problem (name the flag and its value). Anything else a handler raises becomes INTERNAL
with a generic message; the traceback goes to the log, never to the caller.

| condition                        | class                                | gRPC                | HTTP    | caller               |
|----------------------------------|--------------------------------------|---------------------|---------|----------------------|
| malformed input                  | InvalidArgument                      | INVALID_ARGUMENT    | 400     | never retry          |
| unknown request/instance         | NotFound                             | NOT_FOUND           | 404     | never retry          |
| KV cache or queue full           | ResourceExhausted                    | RESOURCE_EXHAUSTED  | 429/503 | back off, go elsewhere |
| draining, lease lost, peer down  | Unavailable                          | UNAVAILABLE         | 503     | retry on another instance |
| lost a race, stale epoch         | Aborted                              | ABORTED             | 409     | retry the whole operation |
| wrong role or state              | FailedPrecondition                   | FAILED_PRECONDITION | 409     | wait for state change |
| not authenticated / not allowed  | Unauthenticated / PermissionDenied   | UNAUTHENTICATED / PERMISSION_DENIED | 401 / 403 | fix credentials |
| anything else (a bug)            | Internal                             | INTERNAL            | 500     | report it            |
"""

from __future__ import annotations

import enum
from typing import ClassVar

import grpc
import structlog
from grpc._cython import cygrpc

from services.common.log_sampling import LogSampler
from services.common.logging import request_id_from_metadata, request_metadata
from services.common.rpc_handler import Behavior, is_streaming_behavior, wrap_rpc_handler

log = structlog.get_logger(__name__)


class CallerAction(enum.Enum):
    NEVER_RETRY = "never_retry"
    BACK_OFF = "back_off"  # back off, or go to another instance
    RETRY_ELSEWHERE = "retry_elsewhere"
    RETRY_OPERATION = "retry_operation"  # redo the whole operation from the start
    WAIT_FOR_STATE = "wait_for_state"
    FIX_CREDENTIALS = "fix_credentials"
    REPORT = "report"  # a bug: retrying will not help


class FerryError(Exception):
    """Base of every error ferry returns across a process boundary."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    caller_action: ClassVar[CallerAction] = CallerAction.REPORT

    def __init__(self, message: str, request_id: str = "", *, is_expected: bool = False,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id  # the request it concerns, where the caller may not know it (a picked one)
        # An answer the caller counts on (an Abort of a request already gone): its rpc_failed line is at debug.
        self.is_expected = is_expected
        # Sent with the status: what the caller must tell apart reliably, not by the message's words (a
        # MigrateOut refused by its source's own busy slots, pick_announcement.py). Not carried on by error_from_rpc.
        self.trailing_metadata = trailing_metadata

    @property
    def is_retryable(self) -> bool:
        return self.caller_action in (CallerAction.BACK_OFF, CallerAction.RETRY_ELSEWHERE,
                                      CallerAction.RETRY_OPERATION)


class InvalidArgument(FerryError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    caller_action = CallerAction.NEVER_RETRY


class NotFound(FerryError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    caller_action = CallerAction.NEVER_RETRY


class ResourceExhausted(FerryError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    caller_action = CallerAction.BACK_OFF


class Unavailable(FerryError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    caller_action = CallerAction.RETRY_ELSEWHERE


class Aborted(FerryError):
    grpc_code = grpc.StatusCode.ABORTED
    http_status = 409
    caller_action = CallerAction.RETRY_OPERATION


class FailedPrecondition(FerryError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    caller_action = CallerAction.WAIT_FOR_STATE


class Unauthenticated(FerryError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    caller_action = CallerAction.FIX_CREDENTIALS


class PermissionDenied(FerryError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    caller_action = CallerAction.FIX_CREDENTIALS


class Internal(FerryError):
    """A bug, or a status outside the table; the server logged the traceback."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[FerryError]] = {
    cls.grpc_code: cls for cls in (InvalidArgument, NotFound, ResourceExhausted, Unavailable, Aborted,
                                   FailedPrecondition, Unauthenticated, PermissionDenied, Internal)
}
# A peer that does not answer within the deadline is treated like a peer that is down.
_ERROR_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable

# grpc-python raises this (a private class) into a handler that reads its request stream
# once the server stops: a shutdown, not a crash.
_SERVER_STOPPED = getattr(cygrpc, "_ServerStoppedError", ())
INTERNAL_MESSAGE = "internal error; the server logged the traceback under this request_id"


# Every status a ferry server sends carries this in its trailing metadata: an UNAVAILABLE with it
# is the server's own answer (a peer of *its* did not answer), one without it is gRPC's (the server
# itself was not reached, or died mid-call).
ANSWERED_KEY = "x-ferry-answered"


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "") -> FerryError:
    """Map a failed call back to the `FerryError` the server raised (Internal for other codes).
    `peer` ("the transfer service at ADDR") names who was called: an UNAVAILABLE then says whether
    it did not answer or answered that something behind it did not (gRPC's own words say neither)."""
    code = exc.code()
    cls = _ERROR_BY_CODE.get(code, Internal)
    details = exc.details() or code.name
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"deadline exceeded: {details}"
    if peer and cls is Unavailable:
        details = f"{peer} answered: {details}" if was_answered(exc) else f"{peer} did not answer: {details}"
    error = cls(details, request_id_from_metadata(exc.trailing_metadata()) or "")
    error.__cause__ = exc
    return error


def was_answered(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a ferry server sent this status (not gRPC on finding no server)."""
    return any(key == ANSWERED_KEY for key, _ in exc.trailing_metadata() or ())


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns a raised `FerryError` into its status; any other exception into INTERNAL, logged.

    `rpc_failed` lines are rate-limited (log_sampling.py): an outage fails every call alike (say each
    Dispatch while no instance serves), so per (method, code, caller's host) the first is logged, then
    at most one per 10 s with `suppressed`; the line names one of the calls' request ids."""

    def __init__(self) -> None:
        self._failure_log = LogSampler()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        return wrap_rpc_handler(handler, lambda behavior: self._map_errors(behavior, method))

    def _map_errors(self, behavior: Behavior, method: str) -> Behavior:
        if is_streaming_behavior(behavior):
            async def stream_with_errors(request, context):
                try:
                    async for response in behavior(request, context):
                        yield response
                except Exception as exc:  # noqa: BLE001 — mapped to a status, never swallowed
                    await self._abort(context, exc, method)
            return stream_with_errors

        async def call_with_errors(request, context):
            try:
                return await behavior(request, context)
            except Exception as exc:  # noqa: BLE001 — mapped to a status, never swallowed
                await self._abort(context, exc, method)
        return call_with_errors

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # the handler already called context.abort
            raise exc
        if isinstance(exc, _SERVER_STOPPED):  # reading a request stream while this server shuts down
            log.info("rpc_cut_by_shutdown", method=method)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another",
                                trailing_metadata=_ANSWERED)
        if isinstance(exc, FerryError):
            self._log_failed(context, exc, method)
            await context.abort(exc.grpc_code, exc.message,
                                trailing_metadata=(*request_metadata(exc.request_id), *exc.trailing_metadata,
                                                   *_ANSWERED))
        log.error("rpc_crashed", method=method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, trailing_metadata=_ANSWERED)

    def _log_failed(self, context: grpc.aio.ServicerContext, exc: FerryError, method: str) -> None:
        peer = _peer_host(context.peer())
        key = (method, exc.grpc_code, peer, exc.is_expected)  # an expected one (debug) holds back no info line
        if (suppressed := self._failure_log.admit(key)) is not None:
            (log.debug if exc.is_expected else log.info)("rpc_failed", method=method, code=exc.grpc_code.name,
                                                          message=exc.message, peer=peer, suppressed=suppressed)


def _peer_host(peer: str) -> str:
    """gRPC's peer ("ipv4:10.0.0.7:53412", "ipv6:[::1]:53412") without its port: a caller's connections
    come from ever new ports, and a key per port would let one caller fill the sampler's table."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{address.rpartition(':')[0]}"
    return peer


_ANSWERED = ((ANSWERED_KEY, "1"),)
