"""start_grpc_server against real sockets: health, reflection, request ids, error mapping."""

from __future__ import annotations

import socket

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common import errors
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.logging import request_metadata
from services.common.startup import StartupError

pytestmark = pytest.mark.timeout(30)

SERVICE = "ferry.test.Echo"


class EchoServicer:
    """Raw-bytes service: `Unary` echoes, `Stream` yields twice, b"fail:..." raises."""

    def __init__(self) -> None:
        self.seen_request_ids: list[str | None] = []

    async def unary(self, request: bytes, context) -> bytes:
        self._raise_if_asked(request)
        return request

    async def stream(self, request: bytes, context):
        yield request
        self._raise_if_asked(request)
        yield request

    def _raise_if_asked(self, request: bytes) -> None:
        self.seen_request_ids.append(structlog.contextvars.get_contextvars().get("request_id"))
        if request == b"fail:not_found":
            raise errors.NotFound("instance i-9 is not registered; check --instance-id")
        if request == b"fail:picked":
            raise errors.Aborted("the destination vanished", request_id="req-picked")
        if request == b"fail:bug":
            raise RuntimeError("secret=hunter2")
        if request == b"fail:its_peer_down":
            raise errors.Unavailable("the transfer service at 127.0.0.1:1 did not answer")


def add_echo(servicer: EchoServicer, server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def echo():
    servicer = EchoServicer()
    server = await start_grpc_server("127.0.0.1", 0, [(add_echo, servicer)], [SERVICE])
    channel = insecure_channel(server.address)
    yield server, servicer, channel
    await channel.close()
    await server.stop(0)


async def test_binds_a_free_port_and_reports_health(echo) -> None:
    server, _, channel = echo
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    await server.set_serving(False)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_services(echo) -> None:
    _, _, channel = echo
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name async for r in call for s in r.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


async def test_request_id_is_bound_for_unary_and_stream(echo) -> None:
    _, servicer, channel = echo
    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    stream = channel.unary_stream(f"/{SERVICE}/Stream")
    assert await unary(b"hi", metadata=request_metadata("req-1"), timeout=5) == b"hi"
    assert [m async for m in stream(b"yo", metadata=request_metadata("req-2"), timeout=5)] == [b"yo", b"yo"]
    assert await unary(b"hi", metadata=request_metadata(None), timeout=5) == b"hi"
    assert servicer.seen_request_ids == ["req-1", "req-2", None]


async def test_ferry_error_becomes_its_status(echo) -> None:
    _, _, channel = echo
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"fail:not_found", timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    mapped = errors.error_from_rpc(caught.value)
    assert isinstance(mapped, errors.NotFound) and "--instance-id" in mapped.message

    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in channel.unary_stream(f"/{SERVICE}/Stream")(b"fail:not_found", timeout=5):
            received.append(message)
    assert received == [b"fail:not_found"]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_request_an_error_concerns_travels_with_it(echo) -> None:
    _, _, channel = echo
    for body, request_id in ((b"fail:picked", "req-picked"), (b"fail:not_found", "")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Unary")(body, timeout=5)
        assert errors.error_from_rpc(caught.value).request_id == request_id


async def test_an_unavailable_says_whether_the_peer_answered_or_was_not_reached(echo) -> None:
    """A server that answers UNAVAILABLE (something behind it is down) is not a server that is down."""
    server, _, channel = echo
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"fail:its_peer_down", timeout=5)
    answered = errors.error_from_rpc(caught.value, peer="the echo at E")
    assert isinstance(answered, errors.Unavailable)
    assert answered.message == "the echo at E answered: the transfer service at 127.0.0.1:1 did not answer"

    port = server.port
    await server.stop(0)  # nothing listens on the port now
    async with insecure_channel(f"127.0.0.1:{port}") as gone:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gone.unary_unary(f"/{SERVICE}/Unary")(b"hi", timeout=5)
    unanswered = errors.error_from_rpc(caught.value, peer="the echo at E")
    assert isinstance(unanswered, errors.Unavailable)
    assert unanswered.message.startswith("the echo at E did not answer: ")
    assert errors.error_from_rpc(caught.value).message == caught.value.details()  # no peer named: gRPC's words


async def test_other_exceptions_become_internal_without_details(echo) -> None:
    _, _, channel = echo
    for call in (channel.unary_unary(f"/{SERVICE}/Unary"), channel.unary_stream(f"/{SERVICE}/Stream")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            result = call(b"fail:bug", timeout=5)
            if hasattr(result, "__aiter__"):
                [m async for m in result]
            else:
                await result
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "hunter2" not in (caught.value.details() or "")


async def test_fixed_port_in_use_fails(echo) -> None:
    server, _, _ = echo
    with pytest.raises(StartupError, match="the port is already in use .*pick another --port"):
        await start_grpc_server("127.0.0.1", server.port, [], [])


async def test_a_wildcard_host_in_brackets_is_probed_too() -> None:
    with socket.socket(socket.AF_INET6) as other:
        other.bind(("::", 0))
        other.listen()
        with pytest.raises(StartupError, match="the port is already in use"):
            await start_grpc_server("[::]", other.getsockname()[1], [], [])


async def test_a_port_held_by_another_program_is_named_in_use() -> None:
    with socket.socket() as other:  # no SO_REUSEADDR, as many programs
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(StartupError, match="the port is already in use"):
            await start_grpc_server("127.0.0.1", other.getsockname()[1], [], [])


async def test_a_server_on_ipv6_loopback_advertises_its_address_in_brackets() -> None:
    # `::1:P` (no brackets) was advertised, which gRPC peers cannot dial.
    server = await start_grpc_server("::1", 0, [], [SERVICE])
    try:
        assert server.address == f"[::1]:{server.port}"
        async with insecure_channel(server.address) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
