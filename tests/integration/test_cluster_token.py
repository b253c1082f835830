"""The cluster token over real sockets: a ferry channel sends it on all four call shapes
and a ferry server checks it (in process), and a real transfer process started with
--cluster-token-file refuses a call without it, or with another, and serves one with it;
health and reflection stay open, and the token reaches neither its log nor its command line."""

from __future__ import annotations

import asyncio
import pathlib
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cluster.processes import ServiceProcess
from services.common.cluster_token import CLUSTER_TOKEN_KEY
from services.common.errors import Unavailable
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import transfer_pb2, transfer_pb2_grpc
from services.common.grpc_server import bind_grpc_server, secure_or_insecure_channel
from services.common.tls import TlsConfig
from services.frontend.generation import InstanceId, Target
from services.frontend.instance_client import InstanceClients
from tests.unit.frontend.factories import make_spec

pytestmark = pytest.mark.timeout(120)

TOKEN = f"cluster-{uuid.uuid4().hex}"
SERVICE = "ferry.test.Echo"
OPEN_SERVICE = "ferry.test.Open"
SHAPES = ("UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream")


async def _unary_unary(request: bytes, context) -> bytes:
    return request


async def _unary_stream(request: bytes, context):
    yield request
    yield request


async def _stream_unary(requests, context) -> bytes:
    return b"".join([request async for request in requests])


async def _stream_stream(requests, context):
    async for request in requests:
        yield request


def _add_echo(service: str):
    def add(_servicer, server: grpc.aio.Server) -> None:
        handlers = {"UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
                    "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
                    "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
                    "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    return add


async def _late(messages: tuple[bytes, ...]):
    """The request messages, sent a little after the call opens."""
    for message in messages:
        await asyncio.sleep(0.02)
        yield message


async def _call(channel: grpc.aio.Channel, service: str, shape: str,
                stream_messages: tuple[bytes, ...] = (b"x", b"y")) -> list[bytes]:
    """One call of `shape`. A server that refuses the call answers at once; a client still writing a
    stream then can see the write fail first (INTERNAL "Internal error from Core", a grpc race on the
    client, more often the busier the machine): ferry has no stream-stream RPC, and its stream-unary
    ones (ReportLoad, ReceiveBlocks) see the status. So calls meant to be refused send no stream
    messages (`stream_messages=()`): the refusal rests on the metadata alone."""
    method = f"/{service}/{shape}"
    if shape == "UnaryUnary":
        return [await channel.unary_unary(method)(b"x", timeout=5)]
    if shape == "UnaryStream":
        return [chunk async for chunk in channel.unary_stream(method)(b"x", timeout=5)]
    if shape == "StreamUnary":
        return [await channel.stream_unary(method)(_late(stream_messages), timeout=5)]
    return [chunk async for chunk in channel.stream_stream(method)(_late(stream_messages), timeout=5)]


@pytest.fixture
async def echo_server():
    server = bind_grpc_server("127.0.0.1", 0, [SERVICE, OPEN_SERVICE], tls=TlsConfig(cluster_token=TOKEN),
                              token_open_services=[OPEN_SERVICE])
    await server.start([(_add_echo(SERVICE), None), (_add_echo(OPEN_SERVICE), None)])
    yield server
    await server.stop(0)


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_channel_with_the_token_is_served_on_every_call_shape(echo_server, shape):
    async with secure_or_insecure_channel(echo_server.address, TlsConfig(cluster_token=TOKEN)) as channel:
        assert b"".join(await _call(channel, SERVICE, shape)) in (b"x", b"xx", b"xy")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("client_token, code", [("", grpc.StatusCode.UNAUTHENTICATED),
                                                ("another", grpc.StatusCode.PERMISSION_DENIED)])
async def test_a_channel_without_the_token_is_refused_on_every_call_shape(echo_server, shape, client_token, code):
    async with secure_or_insecure_channel(echo_server.address, TlsConfig(cluster_token=client_token)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _call(channel, SERVICE, shape, stream_messages=())
        assert caught.value.code() is code and "--cluster-token-file" in caught.value.details()
        assert await _call(channel, OPEN_SERVICE, shape)  # what the server leaves open answers anyone
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("client_token", ["", "another"])
async def test_an_instance_refusing_the_frontend_is_its_own_misconfiguration_not_the_clients(client_token):
    """A frontend started without the cluster's token (or with another): the instance refuses it, and its
    OpenAI client got that 401/403 as `invalid_request_error`, as if its API key were wrong. The frontend
    now takes it as that instance being unusable (UNAVAILABLE: another may accept it; the client gets a
    503 server_error once none does), the message naming the instance and --cluster-token-file."""
    server = bind_grpc_server("127.0.0.1", 0, ["ferry.v1.InstanceService"], tls=TlsConfig(cluster_token=TOKEN))
    await server.start([(_add_generate, None)])
    clients = InstanceClients(generate_timeout_s=5, abort_timeout_s=1, tls=TlsConfig(cluster_token=client_token))
    try:
        with pytest.raises(Unavailable) as caught:
            async for _ in clients.generate(Target(InstanceId("i-0"), server.address), make_spec()):
                pass
        assert server.address in caught.value.message and "--cluster-token-file" in caught.value.message
        assert caught.value.http_status == 503
    finally:
        await clients.close()
        await server.stop(0)


def _add_generate(_servicer, server: grpc.aio.Server) -> None:
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(_unary_stream)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ferry.v1.InstanceService", handlers),))


@pytest.fixture(scope="module")
def transfer(tmp_path_factory):
    """A real transfer process (no etcd) given the token as a file."""
    secrets = tmp_path_factory.mktemp("secrets")
    token_file = secrets / "cluster.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    process = ServiceProcess("transfer", "transfer", ["--port", str(port), "--transfer-id", "t0",
                                                      "--cluster-token-file", str(token_file)],
                             f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs"))
    process.start()
    try:
        asyncio.run(process.wait_healthy(60))  # the health check itself needs no token
        yield process
    finally:
        process.stop()


async def test_a_transfer_process_refuses_calls_without_its_token(transfer):
    request = transfer_pb2.GetTransferStatusRequest()
    for client_token, code in (("", grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.PERMISSION_DENIED)):
        async with secure_or_insecure_channel(transfer.address, TlsConfig(cluster_token=client_token)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await transfer_pb2_grpc.TransferServiceStub(channel).GetStatus(request, timeout=5)
            assert caught.value.code() is code and "--cluster-token-file" in caught.value.details()
    async with secure_or_insecure_channel(transfer.address, TlsConfig(cluster_token=TOKEN)) as channel:
        status = await transfer_pb2_grpc.TransferServiceStub(channel).GetStatus(request, timeout=5)
        assert list(status.instance_ids) == []
    async with secure_or_insecure_channel(transfer.address, None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # a blank token: malformed
            await transfer_pb2_grpc.TransferServiceStub(channel).GetStatus(
                request, timeout=5, metadata=((CLUSTER_TOKEN_KEY, " "),))
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_the_token_is_in_neither_the_log_nor_the_command_line(transfer):
    """After calls with and without the token have been refused and logged."""
    assert "rpc_unauthenticated" in transfer.log_path.read_text(errors="replace")
    assert TOKEN not in transfer.log_path.read_text(errors="replace")
    cmdline = pathlib.Path(f"/proc/{transfer.pid}/cmdline").read_bytes().decode(errors="replace")
    assert TOKEN not in cmdline and "--cluster-token-file" in cmdline
