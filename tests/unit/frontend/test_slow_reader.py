"""A client that stops reading its stream is cut after --send-timeout-s: before, its handler
waited on the socket for ever and kept its --max-inflight slots, so a few such streams (n=16
each) made every later request a 429 for as long as the client kept its connections open
(found by review)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from services.frontend.dispatch import Dispatcher
from services.frontend.generation import FinishReason
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, chunk, entry
from tests.unit.frontend.test_tokenize_off_loop import ThreadNotingTokenizer

pytestmark = pytest.mark.timeout(30)

NUM_TOKENS = 20_000  # ~4 MB of SSE: far more than the socket buffers hold
SEND_TIMEOUT_S = 1.0


def long_answer() -> list:
    return [chunk(i, i % 20, finish=FinishReason.LENGTH if i == NUM_TOKENS - 1 else None) for i in range(NUM_TOKENS)]


async def start_frontend(send_timeout_s: float) -> tuple[web.AppRunner, int]:
    model = ServedModel("m", max_model_len=NUM_TOKENS + 100, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": (long_answer(), None)})
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=1, max_body_bytes=1 << 20,
                            send_timeout_s=send_timeout_s)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    return http, http.addresses[0][1]


def open_stream_never_read(port: int) -> socket.socket:
    """A streaming request from a client with a tiny receive buffer that then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": NUM_TOKENS, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def status_of_next_request(port: int) -> int:
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 1}) as reply:
        await reply.read()
        return reply.status


async def test_a_client_that_stops_reading_gives_its_slot_back():
    http, port = await start_frontend(SEND_TIMEOUT_S)
    stalled = open_stream_never_read(port)
    try:
        # Its answer fills the buffers, then waits on the client; on a loaded machine filling them
        # takes a while, so ask again until the slot is back (without the send timeout: never).
        statuses = [await status_of_next_request(port)]
        deadline = asyncio.get_running_loop().time() + 20
        while statuses[-1] == 429 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
            statuses.append(await status_of_next_request(port))
        assert statuses[-1] != 429, f"the stalled stream kept its slot: {len(statuses)} requests got 429"
    finally:
        stalled.close()
        await http.cleanup()
