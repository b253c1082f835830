"""services.common.logging: setup, request-id metadata and binding (no sockets)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging

import grpc
import pytest
import structlog

from services.common.logging import (
    LogFormat, LogKnobs, RequestIdInterceptor, request_id_from_metadata, request_metadata, setup_logging)

pytestmark = pytest.mark.timeout(10)


def test_request_metadata_round_trip() -> None:
    assert request_metadata("r-1") == (("x-request-id", "r-1"),)
    assert request_metadata(None) == ()
    assert request_id_from_metadata(request_metadata("r-1")) == "r-1"
    assert request_id_from_metadata(None) is None


def test_json_lines_carry_service_and_context(capsys) -> None:
    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    structlog_config = structlog.get_config()  # (tests/conftest.py's: plain tracebacks)
    setup_logging("demo", LogFormat.JSON, "info")
    try:
        log = structlog.get_logger("test")
        with structlog.contextvars.bound_contextvars(request_id="r-9"):
            log.info("request_dispatched", instance_id="i-1")
        log.debug("hidden_below_level")
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert line["event"] == "request_dispatched" and line["service"] == "demo"
        assert line["request_id"] == "r-9" and line["level"] == "info" and "timestamp" in line
        logging.getLogger("grpc").warning("stdlib_line")
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert line["event"] == "stdlib_line" and line["service"] == "demo" and line["logger"] == "grpc"
    finally:
        structlog.configure(**structlog_config)
        logging.getLogger().handlers[:] = root_handlers
        logging.getLogger().setLevel(root_level)


def test_a_console_traceback_leaves_out_the_frames_local_variables(capsys) -> None:
    # rich's tracebacks (structlog's default where rich is installed) print each frame's locals:
    # a crash holding a deeply nested request body printed it once a frame, for minutes
    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    structlog_config = structlog.get_config()  # (tests/conftest.py's: plain tracebacks)
    setup_logging("demo", LogFormat.CONSOLE, "info")
    try:
        big_body = {"prompt": "secret-" + "x" * 100_000}
        try:
            raise ValueError(f"crash with a body of {len(big_body)} keys")
        except ValueError:
            structlog.get_logger("test").exception("request_crashed")
        err = capsys.readouterr().err
        assert "request_crashed" in err and "ValueError: crash with a body of 1 keys" in err
        assert "secret-" not in err and len(err) < 5_000
    finally:
        structlog.configure(**structlog_config)
        logging.getLogger().handlers[:] = root_handlers
        logging.getLogger().setLevel(root_level)


def test_grpcs_error_for_a_status_its_client_no_longer_waits_for_is_left_out(capsys) -> None:
    # Logged as ERROR with a traceback when a client closes a stream just before its final status
    # (found by a fault run); any other gRPC error still shows.
    class ExecuteBatchError(Exception):  # grpc._cython.cygrpc's, by name
        pass

    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    structlog_config = structlog.get_config()  # (tests/conftest.py's: plain tracebacks)
    setup_logging("demo", LogFormat.CONSOLE, "info")
    try:
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        for error in (ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation '
                                        'object at 0x7f>,)'), RuntimeError("a real failure")):
            try:
                raise error
            except Exception:
                grpc_log.exception("ExecuteBatchError raised in core by servicer method [/ferry.v1.X/Attach]")
        err = capsys.readouterr().err
        assert "SendStatusFromServerOperation" not in err and "a real failure" in err
    finally:
        structlog.configure(**structlog_config)
        logging.getLogger().handlers[:] = root_handlers
        logging.getLogger().setLevel(root_level)


def test_bad_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="log level"):
        setup_logging("demo", LogFormat.CONSOLE, "loud")


class HandlerCallDetails:
    method = "/ferry.v1.Test/Call"
    invocation_metadata = (("x-request-id", "r-5"),)


@pytest.mark.parametrize("streaming", [False, True])
async def test_interceptor_binds_request_id_for_the_call(streaming: bool) -> None:
    seen = []

    async def unary(request, context):
        seen.append(structlog.contextvars.get_contextvars().get("request_id"))
        return request

    async def stream(request, context):
        seen.append(structlog.contextvars.get_contextvars().get("request_id"))
        yield request

    async def continuation(_details):
        if streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    handler = await RequestIdInterceptor().intercept_service(continuation, HandlerCallDetails())
    if streaming:
        assert [m async for m in handler.unary_stream(b"x", None)] == [b"x"]
    else:
        assert await handler.unary_unary(b"x", None) == b"x"
    assert seen == ["r-5"]
    assert "request_id" not in structlog.contextvars.get_contextvars()


def test_the_ready_line_follows_the_log_format(capsys) -> None:
    @dataclasses.dataclass(frozen=True)
    class Knobs(LogKnobs):
        pass

    Knobs().print_ready("instance-0", "127.0.0.1:5000")
    assert capsys.readouterr().out == "ready instance-0 127.0.0.1:5000\n"
    Knobs(log_format=LogFormat.JSON).print_ready("instance-0", "127.0.0.1:5000")
    line = json.loads(capsys.readouterr().out)
    # level and timestamp as on every other JSON line (before, a shipper keyed on them dropped this one)
    assert {k: line.pop(k) for k in ("event", "id", "address", "level")} == {
        "event": "ready", "id": "instance-0", "address": "127.0.0.1:5000", "level": "info"}
    assert datetime.datetime.fromisoformat(line.pop("timestamp")).tzinfo is not None and not line
