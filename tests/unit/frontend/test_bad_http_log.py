"""HTTP that aiohttp cannot parse (a header line over 8190 bytes, too many headers, a bad chunk
size) gets aiohttp's 400 and one sampled `bad_http_request` info line. Before, each such request
logged an ERROR with a 9-line traceback from aiohttp.server, so any client could fill the log
with errors at will (found by black-box check #3)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from structlog.testing import capture_logs

from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)

BAD_REQUESTS = {
    "long header": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
    "many headers": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
                    + b"\r\n",
    "bad chunk": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
}


def status_of(base_url: str, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=5) as sock:
        sock.sendall(data)
        return sock.recv(100).split(b"\r\n")[0]


async def test_unparsable_requests_are_400s_logged_once_without_an_error(caplog):
    caplog.set_level(logging.INFO)
    async with scripted_frontend() as base_url:
        with capture_logs() as logs:
            for _ in range(3):
                for data in BAD_REQUESTS.values():
                    assert (await asyncio.to_thread(status_of, base_url, data)).endswith(b" 400 Bad Request")
    errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors
    lines = [(e["error"], e["suppressed"]) for e in logs if e["event"] == "bad_http_request"]
    assert lines == [("LineTooLong", 0), ("BadHttpMessage", 0)], lines  # 9 requests, one line per kind
