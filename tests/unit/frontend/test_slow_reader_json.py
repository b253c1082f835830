"""A client that stops reading a non-streaming answer is cut after --send-timeout-s, as a
streaming one is (test_slow_reader.py). Before, aiohttp wrote the JSON body after the handler
had returned, with no deadline: a client that never read kept the whole body in the
frontend's memory, and its connection open, for as long as it kept the connection (its
--max-inflight slot was already given back, so any number of them could pile up; found by
black-box check #3)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from services.frontend.generation import FinishReason, TokenChunk
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(60)

NUM_TOKENS = 4
TOKEN_TEXT = "x" * 2_500_000  # a 10 MB answer: far more than the socket buffers hold
SEND_TIMEOUT_S = 1.0


def big_answer() -> list[TokenChunk]:
    return [TokenChunk(token_index=i, token_ids=(i,), text=TOKEN_TEXT,
                       finish_reason=FinishReason.LENGTH if i == NUM_TOKENS - 1 else None) for i in range(NUM_TOKENS)]


def send_request_never_read(base_url: str) -> socket.socket:
    """A non-streaming request from a client with a tiny receive buffer that then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(base_url.rsplit(":", 1)[1])))
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": NUM_TOKENS}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def bytes_left_to_read(sock: socket.socket) -> int:
    """Everything the server still sends, until it closes the connection or goes quiet for 2 s."""
    sock.settimeout(2)
    received = 0
    try:
        while data := sock.recv(1 << 20):
            received += len(data)
    except (TimeoutError, ConnectionResetError):
        pass
    return received


async def test_a_client_that_stops_reading_a_json_answer_is_cut():
    async with scripted_frontend({"a": (big_answer(), None)}, send_timeout_s=SEND_TIMEOUT_S) as base_url:
        stalled = send_request_never_read(base_url)
        try:
            await asyncio.sleep(6 * SEND_TIMEOUT_S)  # the answer is ready and waits on the client
            received = await asyncio.to_thread(bytes_left_to_read, stalled)
        finally:
            stalled.close()
    assert received < NUM_TOKENS * len(TOKEN_TEXT), \
        f"the server waited on a client that read nothing for {6 * SEND_TIMEOUT_S:g} s: it got all {received} bytes"
