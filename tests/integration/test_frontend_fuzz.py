"""The frontend under bad input and abuse: its OpenAPI schema fuzzed with schemathesis
(positive and negative data) against a real frontend and instance on a tiny model, and
oversized, over-long, idle and slow requests on raw sockets."""

from __future__ import annotations

import socket
import time
import uuid

import aiohttp
import hypothesis
import pytest
import schemathesis
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, NegativeDataRejectionConfig
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from services.frontend.openapi import openapi_schema

from tests.integration.running import running

pytestmark = pytest.mark.timeout(300)

MODEL_NAME = "tiny-gqa-tied"  # tests/conftest.py's tiny_model_dir folder
MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 16384
API_KEY = "sk-fuzz"
KEEPALIVE_S = 2.0
BODY_TIMEOUT_S = 2.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}

SCHEMA = schemathesis.openapi.from_dict(openapi_schema(MODEL_NAME, MAX_MODEL_LEN, MAX_BODY_BYTES, has_api_keys=True))
SCHEMA.config.generation.update(max_examples=40, deterministic=True)
# A body over --max-body-bytes is refused with 413 before it is read, whatever else is wrong with it.
SCHEMA.config.checks.negative_data_rejection = NegativeDataRejectionConfig(
    expected_statuses=[*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"])


@pytest.fixture(scope="module")
def frontend(etcd, tiny_model_dir, tmp_path_factory):
    assert tiny_model_dir.name == MODEL_NAME
    log_dir = tmp_path_factory.mktemp("logs")
    cluster = f"fuzz-fe-{uuid.uuid4().hex[:8]}"
    instance_port, frontend_port = free_port(), free_port()
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--max-model-len", str(MAX_MODEL_LEN)]
    instance = ServiceProcess(
        "instance", "instance", ["--model", str(tiny_model_dir), "--port", str(instance_port), "--num-threads", "1",
                                 "--num-blocks", "128", "--block-size", "4", *common],
        f"127.0.0.1:{instance_port}", log_dir)
    frontend = ServiceProcess(
        "frontend", "frontend", ["--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(frontend_port),
                                 "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES),
                                 "--keepalive-timeout-s", str(KEEPALIVE_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                                 *common],
        f"http://127.0.0.1:{frontend_port}", log_dir)
    with running(instance, frontend):
        yield frontend


@SCHEMA.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_schema_fuzz(case, frontend):
    """No 5xx; every answer as documented; every rejection an OpenAI error body with a message."""
    response = case.call(base_url=frontend.address, headers=AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance, negative_data_rejection])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    assert frontend.is_alive()


async def test_openapi_json_is_served_without_a_key(frontend):
    async with aiohttp.ClientSession(base_url=frontend.address) as http:
        async with http.get("/openapi.json") as response:
            assert response.status == 200
            served = await response.json()
    assert set(served["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    assert served["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]


async def test_prompt_over_the_context_is_rejected_before_dispatch(frontend):
    body = {"model": MODEL_NAME, "prompt": list(range(1, MAX_MODEL_LEN + 10)), "max_tokens": 1}
    async with aiohttp.ClientSession(base_url=frontend.address, headers=AUTH) as http:
        started = time.monotonic()
        async with http.post("/v1/completions", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert time.monotonic() - started < 5.0  # refused up front, not after a generation
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_oversized_body_is_rejected_before_it_is_read(frontend):
    """A Content-Length over the limit gets 413 at once, without the body being sent."""
    with _connect(frontend) as sock:
        sock.sendall(_headers("POST", "/v1/completions", content_length=50 * MAX_BODY_BYTES))
        reply = _read_reply(sock, timeout_s=5.0)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"message"' in reply


def test_idle_connection_is_closed(frontend):
    with _connect(frontend) as sock:
        started = time.monotonic()
        assert _read_reply(sock, timeout_s=KEEPALIVE_S + 10) == b""
        assert KEEPALIVE_S - 0.5 <= time.monotonic() - started <= KEEPALIVE_S + 6


def test_slow_headers_are_cut_off(frontend):
    """Slowloris: a header line trickling in never completes a request; the server closes it."""
    with _connect(frontend) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < KEEPALIVE_S + 10:
            closed = _trickle_one_header(sock)
    assert closed, "the server kept a slow-header connection open"
    assert time.monotonic() - started <= KEEPALIVE_S + 6


def _trickle_one_header(sock: socket.socket) -> bool:
    """Sends one more header line and waits briefly; True once the server has closed.

    A server that closes while our unread bytes sit in its buffer answers with a reset,
    which is as much a close as an orderly end of stream.
    """
    try:
        sock.sendall(b"X-Slow: a\r\n")
        sock.settimeout(0.5)
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except (BrokenPipeError, ConnectionResetError):
        return True


def test_slow_body_times_out_with_408(frontend):
    with _connect(frontend) as sock:
        sock.sendall(_headers("POST", "/v1/completions", content_length=200) + b'{"prompt": "')
        reply = _read_reply(sock, timeout_s=BODY_TIMEOUT_S + 10)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--body-timeout-s" in reply


def _connect(frontend) -> socket.socket:
    host, port = frontend.address.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _headers(method: str, path: str, content_length: int) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n").encode()


def _read_reply(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes (or `timeout_s`)."""
    sock.settimeout(timeout_s)
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        if b"\r\n\r\n" in b"".join(chunks) and chunks[-1].endswith((b"}", b"}\n")):
            break
    return b"".join(chunks)
