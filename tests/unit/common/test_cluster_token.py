"""The cluster token: the server guard (missing, malformed, wrong, right; unary and streaming;
health, reflection and unguarded services open), the client's token channel on all four call
shapes, the knobs, and that the token shows in no repr or logged config. No sockets."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest
from structlog.testing import capture_logs

from services.common import cluster_token
from services.common.cluster_token import CLUSTER_TOKEN_KEY
from services.common.config import as_dict, parse_config
from services.ctl.config import CtlConfig
from services.frontend.config import FrontendConfig
from services.instance.config import InstanceConfig
from services.manager.config import ManagerConfig
from services.transfer.config import TransferConfig

pytestmark = pytest.mark.timeout(30)

TOKEN = "c1uster-t0ken-never-shown"
GUARDED = "ferry.v1.InstanceService"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class FakeContext:
    async def abort(self, code, message):
        raise Aborted(code, message)


async def unary_ok(request, context):
    return "answered"


async def stream_ok(request, context):
    yield "chunk"


def details(method: str, metadata=()) -> SimpleNamespace:
    """What grpc hands a server interceptor (grpc.HandlerCallDetails is a protocol)."""
    return SimpleNamespace(method=method, invocation_metadata=tuple(metadata))


async def run_guarded(method: str, metadata, is_streaming: bool = False):
    """What the guarded handler answers: its result, or the Aborted it raised."""
    [guard] = cluster_token.server_interceptors(TOKEN, [GUARDED])
    behavior = stream_ok if is_streaming else unary_ok
    field = "unary_stream" if is_streaming else "unary_unary"
    handler = (grpc.unary_stream_rpc_method_handler if is_streaming else grpc.unary_unary_rpc_method_handler)(behavior)

    async def continuation(_details):
        return handler
    wrapped = await guard.intercept_service(continuation, details(method, metadata))
    try:
        if is_streaming:
            return [chunk async for chunk in getattr(wrapped, field)(None, FakeContext())]
        return await getattr(wrapped, field)(None, FakeContext())
    except Aborted as exc:
        return exc


@pytest.mark.parametrize("is_streaming", [False, True])
@pytest.mark.parametrize("metadata, code, words", [
    ((), grpc.StatusCode.UNAUTHENTICATED, "missing cluster token"),
    (((CLUSTER_TOKEN_KEY, "   "),), grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    (((CLUSTER_TOKEN_KEY, "not-the-token"),), grpc.StatusCode.PERMISSION_DENIED, "wrong cluster token"),
    ((("authorization", f"Bearer {TOKEN}"),), grpc.StatusCode.UNAUTHENTICATED, "missing cluster token"),
])
def test_a_call_without_the_right_token_is_refused_naming_the_flag(metadata, code, words, is_streaming):
    answer = asyncio.run(run_guarded(f"/{GUARDED}/Abort", metadata, is_streaming))
    assert isinstance(answer, Aborted) and answer.code is code
    assert words in answer.message and "--cluster-token-file" in answer.message
    assert TOKEN not in answer.message


@pytest.mark.parametrize("is_streaming", [False, True])
def test_a_call_with_the_token_is_served(is_streaming):
    answer = asyncio.run(run_guarded(f"/{GUARDED}/Generate", [(CLUSTER_TOKEN_KEY, TOKEN)], is_streaming))
    assert answer == (["chunk"] if is_streaming else "answered")


@pytest.mark.parametrize("method", ["/grpc.health.v1.Health/Check",
                                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                    "/ferry.v1.AdminService/ListInstances"])
def test_health_reflection_and_unguarded_services_stay_open(method):
    assert asyncio.run(run_guarded(method, ())) == "answered"


def test_no_token_no_guard():
    assert cluster_token.server_interceptors("", [GUARDED]) == []
    channel = object()
    assert cluster_token.with_token(channel, "") is channel


class RecordingChannel:
    """Hands out multi-callables that record how they were made and called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object, dict]] = []

    def __getattr__(self, shape: str):
        def multi_callable(method, request_serializer=None, response_deserializer=None, _registered_method=False):
            assert _registered_method is True  # passed through as the generated stubs give it
            return lambda request, **kwargs: self.calls.append((shape, method, request, kwargs)) or "call"
        return multi_callable


@pytest.mark.parametrize("shape", ["unary_unary", "unary_stream", "stream_unary", "stream_stream"])
def test_the_token_channel_adds_the_token_to_every_call_shape(shape):
    recording = RecordingChannel()
    channel = cluster_token.with_token(recording, TOKEN)
    method = getattr(channel, shape)("/ferry.v1.InstanceService/Abort", None, None, _registered_method=True)
    stale = grpc.aio.Metadata(("x-request-id", "r1"), (CLUSTER_TOKEN_KEY, "stale"))
    assert method("request", timeout=1.0, metadata=stale) == "call"
    [(called_shape, called_method, request, kwargs)] = recording.calls
    assert (called_shape, called_method, request) == (shape, "/ferry.v1.InstanceService/Abort", "request")
    assert kwargs == {"timeout": 1.0, "metadata": (("x-request-id", "r1"), (CLUSTER_TOKEN_KEY, TOKEN))}
    assert TOKEN not in repr(channel) and TOKEN not in repr(method)


def test_the_token_channel_adds_the_token_to_a_call_without_metadata():
    recording = RecordingChannel()
    cluster_token.with_token(recording, TOKEN).unary_unary("/m", _registered_method=True)(None)
    assert recording.calls == [("unary_unary", "/m", None, {"metadata": ((CLUSTER_TOKEN_KEY, TOKEN),)})]


def test_the_token_channel_takes_nothing_but_the_request_by_position():
    """grpc.aio's stream shapes take timeout and metadata by position too: given so, metadata would skip the token."""
    method = cluster_token.with_token(RecordingChannel(), TOKEN).stream_unary("/m", _registered_method=True)
    with pytest.raises(TypeError):
        method(iter(()), 5.0, (("x-request-id", "r1"),))


@pytest.mark.parametrize(("cls", "service", "extra"), [
    (ManagerConfig, "manager", []), (InstanceConfig, "instance", []), (TransferConfig, "transfer", []),
    (FrontendConfig, "frontend", ["--etcd-endpoints", "e:1"]),
])
def test_every_service_takes_the_token_from_a_file_or_env_and_never_shows_it(cls, service, extra, tmp_path):
    token_file = tmp_path / "cluster.token"
    token_file.write_text(f"{TOKEN}\n")
    config = parse_config(cls, service, ["--cluster-token-file", str(token_file), *extra], env={})
    assert config.tls.cluster_token == TOKEN
    assert TOKEN not in repr(config.tls) and TOKEN not in repr(config)
    assert TOKEN not in json.dumps(as_dict(config), default=str)
    from_env = parse_config(cls, service, extra, env={f"FERRY_{service.upper()}_CLUSTER_TOKEN": TOKEN})
    assert from_env.tls.cluster_token == TOKEN
    assert parse_config(cls, service, extra, env={}).tls.cluster_token == ""


@pytest.mark.parametrize("content, words", [("", "is empty"), ("two words", "printable ASCII"),
                                            ("tök", "printable ASCII")])
def test_an_unusable_token_file_is_a_usage_error_naming_the_flag(content, words, tmp_path, capsys):
    token_file = tmp_path / "cluster.token"
    token_file.write_text(content)
    with pytest.raises(SystemExit):
        parse_config(InstanceConfig, "instance", ["--cluster-token-file", str(token_file)], env={})
    err = capsys.readouterr().err
    assert "--cluster-token" in err and words in err
    if content:
        assert content not in err  # the token is never quoted


def test_ferryctl_has_no_cluster_token_flag():
    """It calls only the admin API (and health), which the cluster token does not guard."""
    assert "cluster_token" not in CtlConfig.__dataclass_fields__


@pytest.mark.parametrize("is_streaming", [False, True])
def test_a_synchronous_behaviour_is_refused_too(is_streaming):
    """The guard fails closed: before, it replaced only async behaviours (wrap_rpc_handler leaves the
    others alone), so a servicer method written without `async` was served to any caller."""
    [guard] = cluster_token.server_interceptors(TOKEN, [GUARDED])

    def sync_unary(request, context):
        return "answered"

    def sync_stream(request, context):
        yield "chunk"
    handler = (grpc.unary_stream_rpc_method_handler(sync_stream) if is_streaming
               else grpc.unary_unary_rpc_method_handler(sync_unary))

    async def continuation(_details):
        return handler

    async def call():
        wrapped = await guard.intercept_service(continuation, details(f"/{GUARDED}/Abort"))
        try:
            if is_streaming:
                return [chunk async for chunk in wrapped.unary_stream(None, FakeContext())]
            return await wrapped.unary_unary(None, FakeContext())
        except Aborted as exc:
            return exc
    answer = asyncio.run(call())
    assert isinstance(answer, Aborted) and answer.code is grpc.StatusCode.UNAUTHENTICATED


def test_a_flood_of_refused_calls_logs_one_line_per_method_and_code():
    """Before, every refused call logged rpc_unauthenticated: a flood of bad callers flooded the log."""
    [guard] = cluster_token.server_interceptors(TOKEN, [GUARDED])
    handler = grpc.unary_unary_rpc_method_handler(unary_ok)

    async def continuation(_details):
        return handler

    async def refuse(method: str, metadata=()) -> None:
        wrapped = await guard.intercept_service(continuation, details(method, metadata))
        with pytest.raises(Aborted):
            await wrapped.unary_unary(None, FakeContext())

    async def flood() -> None:
        for _ in range(50):
            await refuse(f"/{GUARDED}/Abort")
        await refuse(f"/{GUARDED}/Generate")
        await refuse(f"/{GUARDED}/Abort", [(CLUSTER_TOKEN_KEY, "not-the-token")])
    with capture_logs() as logs:
        asyncio.run(flood())
    lines = [(e["method"], e["code"], e["suppressed"]) for e in logs if e["event"] == "rpc_unauthenticated"]
    assert lines == [(f"/{GUARDED}/Abort", "UNAUTHENTICATED", 0), (f"/{GUARDED}/Generate", "UNAUTHENTICATED", 0),
                     (f"/{GUARDED}/Abort", "PERMISSION_DENIED", 0)]


def test_a_flood_of_calls_to_made_up_methods_of_a_guarded_service_logs_one_line():
    """A method the server does not have (gRPC answers UNIMPLEMENTED) is named by the caller: keyed by its name,
    a caller cycling through made-up names logged every call (and pushed real methods' keys out of the table)."""
    [guard] = cluster_token.server_interceptors(TOKEN, [GUARDED])

    async def unknown(_details):
        return None

    async def flood() -> None:
        for n in range(50):
            assert await guard.intercept_service(unknown, details(f"/{GUARDED}/NoSuchMethod{n}")) is None
    with capture_logs() as logs:
        asyncio.run(flood())
    assert [e["method"] for e in logs if e["event"] == "rpc_unauthenticated"] == [f"/{GUARDED}/NoSuchMethod0"]
