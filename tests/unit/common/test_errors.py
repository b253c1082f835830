"""services.common.errors: the table, mapping back from a status, the server interceptor (no sockets)."""

from __future__ import annotations

import grpc
from grpc._cython import cygrpc
import pytest
from structlog.testing import capture_logs

from services.common import errors

pytestmark = pytest.mark.timeout(10)

TABLE = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, 400, False),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND, 404, False),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, True),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE, 503, True),
    (errors.Aborted, grpc.StatusCode.ABORTED, 409, True),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, 409, False),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401, False),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, 403, False),
    (errors.Internal, grpc.StatusCode.INTERNAL, 500, False),
]


def rpc_error(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(("cls", "code", "http_status", "is_retryable"), TABLE)
def test_table(cls, code, http_status, is_retryable) -> None:
    error = cls("set --max-blocks higher")
    assert isinstance(error, errors.FerryError)
    assert (error.grpc_code, error.http_status, error.is_retryable) == (code, http_status, is_retryable)
    assert error.message == str(error) == "set --max-blocks higher"


@pytest.mark.parametrize(("cls", "code", "_http", "_retry"), TABLE)
def test_error_from_rpc_round_trips(cls, code, _http, _retry) -> None:
    exc = rpc_error(code, "instance i-3 is draining")
    mapped = errors.error_from_rpc(exc)
    assert type(mapped) is cls and mapped.message == "instance i-3 is draining" and mapped.__cause__ is exc


def test_error_from_rpc_outside_the_table() -> None:
    assert isinstance(errors.error_from_rpc(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, None)), errors.Unavailable)
    unknown = errors.error_from_rpc(rpc_error(grpc.StatusCode.UNIMPLEMENTED, None))
    assert type(unknown) is errors.Internal and unknown.message == "UNIMPLEMENTED"


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, peer: str = "ipv4:127.0.0.1:50000") -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()) -> None:
        self.status = (code, details)
        raise Aborted


class HandlerCallDetails:
    method = "/ferry.v1.Test/Call"
    invocation_metadata = ()


async def intercepted(behavior, streaming: bool, interceptor: errors.ErrorInterceptor | None = None,
                      method: str = HandlerCallDetails.method):
    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler

    async def continuation(_details):
        return make(behavior)

    details = HandlerCallDetails()
    details.method = method
    handler = await (interceptor or errors.ErrorInterceptor()).intercept_service(continuation, details)
    return handler.unary_stream if streaming else handler.unary_unary


@pytest.mark.parametrize(("raised", "status"), [
    (errors.ResourceExhausted("no free blocks; raise --num-blocks"),
     (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks; raise --num-blocks")),
    # A request stream read while the server shuts down: a shutdown, not a crash (no INTERNAL).
    (cygrpc._ServerStoppedError("Server already stopped."),
     (grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another")),
], ids=["ferry_error", "server_stopped"])
async def test_interceptor_maps_an_error_unary(raised, status) -> None:
    async def behavior(request, context):
        raise raised

    context = FakeContext()
    with pytest.raises(Aborted):
        await (await intercepted(behavior, streaming=False))(b"", context)
    assert context.status == status


async def test_interceptor_maps_ferry_error_mid_stream() -> None:
    async def behavior(request, context):
        yield 1
        raise errors.Aborted("stale epoch 3")

    context, received = FakeContext(), []
    with pytest.raises(Aborted):
        async for item in (await intercepted(behavior, streaming=True))(b"", context):
            received.append(item)
    assert received == [1] and context.status == (grpc.StatusCode.ABORTED, "stale epoch 3")


async def test_interceptor_hides_unexpected_exceptions() -> None:
    async def behavior(request, context):
        raise KeyError("password=hunter2")

    context = FakeContext()
    with pytest.raises(Aborted):
        await (await intercepted(behavior, streaming=False))(b"", context)
    assert context.status[0] == grpc.StatusCode.INTERNAL and "hunter2" not in context.status[1]


async def test_interceptor_passes_results_through() -> None:
    async def behavior(request, context):
        return request + b"!"

    assert await (await intercepted(behavior, streaming=False))(b"ok", FakeContext()) == b"ok!"


@pytest.mark.parametrize(("is_expected", "level"), [(False, "info"), (True, "debug")])
async def test_an_expected_error_is_logged_at_debug(is_expected, level) -> None:
    """An Abort of a request already gone answers NOT_FOUND, which is what its caller wanted: before, each
    logged rpc_failed at info (one per client that hung up while its cancelled stream got there first)."""
    async def behavior(request, context):
        raise errors.NotFound("request r is not on instance i", is_expected=is_expected)

    context = FakeContext()
    with capture_logs() as logs, pytest.raises(Aborted):
        await (await intercepted(behavior, streaming=False))(b"", context)
    assert context.status == (grpc.StatusCode.NOT_FOUND, "request r is not on instance i")
    assert [(e["event"], e["log_level"], e["code"]) for e in logs] == [("rpc_failed", level, "NOT_FOUND")]



async def test_a_flood_of_failed_calls_logs_one_line_per_method_code_and_caller() -> None:
    """Before, every failed call logged rpc_failed: an outage (each Dispatch refused while no instance
    serves) logged one line per call. Now per (method, code, caller's host, not its port) the first is
    logged, then one per 10 s with `suppressed`; distinct failures each still get their line."""
    interceptor = errors.ErrorInterceptor()

    async def fail(raised: errors.FerryError, peer: str, method: str = "/ferry.v1.ManagerService/Dispatch") -> None:
        async def behavior(request, context):
            raise raised
        with pytest.raises(Aborted):
            await (await intercepted(behavior, streaming=False, interceptor=interceptor, method=method))(
                b"", FakeContext(peer))

    with capture_logs() as logs:
        for port in range(40000, 40050):  # one frontend, its calls on ever new connections
            await fail(errors.Unavailable("no instance"), f"ipv4:10.0.0.7:{port}")
        await fail(errors.Unavailable("no instance"), "ipv4:10.0.0.8:40000")  # another frontend
        await fail(errors.ResourceExhausted("queue full"), "ipv4:10.0.0.7:40000")  # another code
        await fail(errors.Unavailable("draining"), "ipv6:[::1]:40000", method="/ferry.v1.InstanceService/Generate")
    lines = [(e["method"].rpartition("/")[2], e["code"], e["peer"], e["suppressed"])
             for e in logs if e["event"] == "rpc_failed"]
    assert lines == [("Dispatch", "UNAVAILABLE", "ipv4:10.0.0.7", 0), ("Dispatch", "UNAVAILABLE", "ipv4:10.0.0.8", 0),
                     ("Dispatch", "RESOURCE_EXHAUSTED", "ipv4:10.0.0.7", 0),
                     ("Generate", "UNAVAILABLE", "ipv6:[::1]", 0)]
