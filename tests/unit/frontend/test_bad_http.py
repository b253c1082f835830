"""HTTP that aiohttp cannot parse (a bad request line, method or header, a header line over 8190 bytes,
too many headers, TLS on the HTTP port) gets a 400 with an OpenAI error body,
the connection closed after it (as aiohttp's own answer: an HTTP/1.0 one), and one sampled `bad_http_request` info line.
Before, each such request logged an ERROR with a 9-line traceback from aiohttp.server, so any client
could fill the log with errors at will (found by black-box check #3); and until 2026-12-07 the answer was
aiohttp's plain text ("Invalid header token: ..."), which an OpenAI client's JSON error handling
could not read (a black-box run)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time

import pytest
from structlog.testing import capture_logs

from services.frontend.bad_http import BadHttpLog, _header_ends, bad_http_body
from services.frontend.metrics import FrontendMetrics
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)

BAD_REQUESTS = {
    "long header": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
    "many headers": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
                    + b"\r\n",
}  # (a bad chunk size is the request's body's error: its handler answers it, test_a_bad_chunk_... below)

MORE_BAD_REQUESTS = {  # (request, what the message names)
    "garbage": (b"GARBAGE\r\n\r\n", "Invalid method encountered: b'GARBAGE'"),
    "bad method": (b"G@T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", "Invalid method encountered"),
    "bad version": (b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n", "Invalid HTTP version"),
    "bad header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
                   "Invalid header token: b'Bad Header: y'"),
    "NUL in header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", "Invalid header value char"),
    "long url": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "Got more than 8190 bytes"),
    "Content-Length and chunked": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding can't be present"),
    "TLS hello": (bytes.fromhex("16030100a5010000a10303") + bytes(40), "Received HTTPS traffic on an HTTP port"),
}


def exchange(base_url: str, data: bytes) -> bytes:
    """All the server sends back before it closes the connection."""
    with socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=5) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):  # a timeout here (the connection left open) fails the test
            answer += chunk
        return answer


def status_of(base_url: str, data: bytes) -> bytes:
    return exchange(base_url, data).split(b"\r\n")[0]


def parsed(answer: bytes) -> tuple[bytes, dict[bytes, bytes], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(b": ") for line in lines)}
    assert int(headers[b"content-length"]) == len(body)  # all of it, then the server closed
    return status, headers, json.loads(body)


async def test_unparsable_requests_are_400s_logged_once_without_an_error(caplog):
    caplog.set_level(logging.INFO)
    server_log = logging.getLogger("aiohttp.server")
    for earlier in [f for f in server_log.filters if isinstance(f, BadHttpLog)]:  # sampling another test's kinds
        server_log.removeFilter(earlier)
    async with scripted_frontend() as base_url:
        with capture_logs() as logs:
            for _ in range(3):
                for data in BAD_REQUESTS.values():
                    assert (await asyncio.to_thread(status_of, base_url, data)).endswith(b" 400 Bad Request")
    errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors
    lines = [(e["error"], e["suppressed"]) for e in logs if e["event"] == "bad_http_request"]
    assert lines == [("LineTooLong", 0), ("BadHttpMessage", 0)], lines  # 6 requests, one line per kind


async def test_unparsable_requests_get_an_openai_error_body_and_a_closed_connection():
    cases = {name: (data, None) for name, data in BAD_REQUESTS.items()} | MORE_BAD_REQUESTS
    async with scripted_frontend() as base_url:
        for name, (data, named) in cases.items():
            status, headers, body = parsed(await asyncio.to_thread(exchange, base_url, data))
            assert status.endswith(b" 400 Bad Request"), name
            assert headers[b"content-type"] == b"application/json; charset=utf-8", name
            error = body["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "bad_request", name
            assert error["param"] is None, name
            assert error["message"].startswith("the HTTP request could not be parsed: "), name
            assert "\n" not in error["message"] and len(error["message"]) < 400, name
            assert named is None or named in error["message"], (name, error["message"])


async def test_a_good_request_on_the_same_server_is_answered_as_before():
    async with scripted_frontend() as base_url:
        answer = await asyncio.to_thread(exchange, base_url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                                             b"Connection: close\r\n\r\n")
    status, _, body = parsed(answer)
    assert status == b"HTTP/1.1 200 OK" and body["data"][0]["id"] == "m"


def test_errors_aiohttp_answers_itself_are_openai_bodies():
    assert bad_http_body(500, None) == {"error": {
        "message": "Internal Server Error; the server logged it", "type": "server_error", "param": None,
        "code": "internal_server_error"}}
    assert bad_http_body(504, None)["error"]["code"] == "gateway_timeout"
    assert bad_http_body(431, None)["error"] == {
        "message": "the HTTP request could not be parsed: Request Header Fields Too Large",
        "type": "invalid_request_error", "param": None, "code": "request_header_fields_too_large"}
    long = bad_http_body(400, "Invalid header token:\n\n  b'" + "x" * 500 + "'\n       ^")["error"]["message"]
    assert long.startswith("the HTTP request could not be parsed: Invalid header token: b'xxx")
    assert long.endswith("...") and len(long) == len("the HTTP request could not be parsed: ") + 303


def exchange_in_two(base_url: str, headers: bytes, rest: bytes, pause_s: float) -> tuple[bytes, float]:
    """What the server sends back to headers and, after a pause (none: one packet), the rest; and how long
    it took. Waits past BODY_TIMEOUT_S, so that a server waiting for the body shows its 408."""
    with socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=BODY_TIMEOUT_S + 5) as sock:
        started = time.monotonic()
        if pause_s:
            sock.sendall(headers)
            time.sleep(pause_s)  # the handler has the headers and waits for the body
            started = time.monotonic()
        sock.sendall(rest if pause_s else headers + rest)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer, time.monotonic() - started


BODY_TIMEOUT_S = 20.0


@pytest.mark.timeout(BODY_TIMEOUT_S + 40)  # a server that waits for the body fails on its 408, not on this
async def test_a_bad_chunk_after_the_headers_is_a_400_at_once_not_a_408_after_the_body_timeout():
    """aiohttp's C parser drops a body whose chunk framing breaks after its headers were handed on
    without ending it: the handler waited --body-timeout-s (30 s) and answered 408 (a black-box run).
    "At once" is "long before the body timeout": the answer waits on nothing, but a loaded machine can take
    seconds to schedule the server (a bound of 2 s had little margin in a loaded run)."""
    headers = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    async with scripted_frontend(body_timeout_s=BODY_TIMEOUT_S) as base_url:
        for rest, pause_s in ((b'5\r\n{"mod\r\nZZ\r\n', 0.2), (b"ZZ\r\n", 0.2), (b"zz\r\nab\r\n0\r\n\r\n", 0)):
            # mid-body, at the first chunk, and with the headers in one packet (the same answer since pipelined
            # requests are parsed apart, JsonErrorRequestHandler.data_received; before, the parser's refusal)
            answer, took_s = await asyncio.to_thread(exchange_in_two, base_url, headers, rest, pause_s)
            status, _, body = parsed(answer)  # one answer, then the connection closed
            assert status == b"HTTP/1.1 400 Bad Request" and took_s < BODY_TIMEOUT_S / 2, (status, took_s)
            message = body["error"]["message"]
            assert message.startswith("the request body could not be read: Invalid character in chunk size"), message
            assert "Transfer-Encoding: chunked" in message and "\n" not in message, message
        assert (await asyncio.to_thread(status_of, base_url, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                                            b"Connection: close\r\n\r\n")) == b"HTTP/1.1 200 OK"


async def test_unparsable_http_is_counted_under_endpoint_unparsable():
    """Before, aiohttp's own answers bypassed the error middleware and ferry_frontend_requests_total
    counted none of them: a flood of garbage on the port showed nowhere on a dashboard (a review)."""
    metrics = FrontendMetrics()
    async with scripted_frontend(metrics=metrics) as base_url:
        for data in BAD_REQUESTS.values():
            assert (await asyncio.to_thread(status_of, base_url, data)).endswith(b" 400 Bad Request")
    assert metrics.registry.get_sample_value("ferry_frontend_requests_total",
                                             {"endpoint": "unparsable", "status": "400"}) == len(BAD_REQUESTS)


def answers_of(answer: bytes) -> list[tuple[bytes, dict]]:
    """The status lines and JSON bodies of the answers in `answer`, in order."""
    found = []
    while answer:
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        found.append((head.split(b"\r\n")[0], json.loads(rest[:length])))
        answer = rest[length:]
    return found


async def test_pipelined_requests_before_garbage_in_the_same_packet_are_answered_then_the_400():
    """aiohttp's parser hands on the requests of a read only if all of it parses: a good request
    followed by garbage in one packet got no answer, the garbage's 400 the only one (a review)."""
    good = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
            b'POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n\r\n{"prompt": "ab"}')
    async with scripted_frontend() as base_url:
        for garbage in (b"GARBAGE\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nBad Header: y\r\n\r\n"):
            answers = answers_of(await asyncio.to_thread(exchange, base_url, good + garbage))
            assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK",
                                                         b"HTTP/1.0 400 Bad Request"], answers
            assert answers[0][1]["data"][0]["id"] == "m" and answers[1][1]["tokens"] == [0, 1]
            assert answers[2][1]["error"]["code"] == "bad_request"


def test_a_read_is_cut_after_each_blank_line_and_an_empty_one_passes_on():
    """aiohttp itself calls data_received(b"") to re-parse what it buffered: that must reach the parser."""
    assert list(_header_ends(b"")) == [b""] and list(_header_ends(b'{"a": 1}')) == [b'{"a": 1}']
    assert list(_header_ends(b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.0\n\nzz")) == [
        b"GET / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.0\n\n", b"zz"]
    assert list(_header_ends(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")) == [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]
