"""An Authorization header that is not UTF-8 is a wrong key (401), not a crash: the key's text
held surrogates that `.encode()` refused, so any client without a key could get a 500 and a
traceback in the log per request (found by review)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from services.frontend.dispatch import Dispatcher
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, entry
from tests.unit.frontend.test_tokenize_off_loop import ThreadNotingTokenizer

pytestmark = pytest.mark.timeout(30)


async def start_frontend() -> tuple[web.AppRunner, int]:
    model = ServedModel("m", max_model_len=100, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    server = FrontendServer(model, RequestRunner(dispatcher, ScriptedInstances({}), max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=("right-key",), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    return http, http.addresses[0][1]


async def status_with_raw_authorization(port: int, value: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": 1}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                 b"Authorization: " + value + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = await reader.read()
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer right-key\xff", b"\xffBearer right-key"])
async def test_a_key_that_is_not_utf8_is_a_401(value):
    http, port = await start_frontend()
    try:
        status, body = await status_with_raw_authorization(port, value)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    finally:
        await http.cleanup()
