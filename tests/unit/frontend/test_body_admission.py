"""A request body being read holds a --max-inflight slot, so the bodies in the frontend's memory stay
within --max-inflight x --max-body-bytes; past it a request is a 429 before its body is read. Before,
admission came after the body: 300 connections sending 1 MB bodies slowly took 350 MB of the
frontend's memory, and nothing but the number of connections bounded it (found by black-box check #3)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)

BODY_BYTES = 100_000


def start_slow_body(base_url: str) -> socket.socket:
    """Headers and the first bytes of a body that never completes."""
    sock = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n{\"model\": \"m\", \"prompt\": \"" % BODY_BYTES)
    return sock


def status_line(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    try:
        return sock.recv(100).split(b"\r\n")[0]
    except TimeoutError:
        return b"no answer"


async def test_bodies_being_read_count_against_max_inflight():
    async with scripted_frontend(max_inflight=2, body_timeout_s=20) as base_url:
        slow = [start_slow_body(base_url) for _ in range(2)]
        try:
            await asyncio.sleep(0.5)  # both are reading their bodies
            third = start_slow_body(base_url)
            try:
                assert await asyncio.to_thread(status_line, third) == b"HTTP/1.1 429 Too Many Requests"
            finally:
                third.close()
        finally:
            for sock in slow:
                sock.close()
