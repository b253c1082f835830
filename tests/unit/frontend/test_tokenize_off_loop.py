"""Tokenizing a prompt runs off the event loop, echo included: a 1 MB prompt with `echo` and
`truncate_prompt_tokens` was encoded a second time on the loop and stalled every stream of the
frontend for about 0.45 s (found by review)."""

from __future__ import annotations

import threading

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

pytestmark = pytest.mark.timeout(30)


class ThreadNotingTokenizer:
    """Letters a..t; notes whether any encode ran on the event loop's thread."""

    def __init__(self) -> None:
        self.encoded_on_loop = False

    def encode(self, text, add_special_tokens=True):
        self.encoded_on_loop |= threading.current_thread() is threading.main_thread()
        return [ord(c) - ord("a") for c in text]

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in token_ids)

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()


@pytest.mark.parametrize("fields", [{}, {"echo": True}, {"echo": True, "truncate_prompt_tokens": 3}])
async def test_no_prompt_is_encoded_on_the_event_loop(fields):
    tokenizer = ThreadNotingTokenizer()
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=tokenizer)
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)})
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions",
                json={"model": "m", "prompt": "abcdefgh", "max_tokens": 1, **fields}) as response:
            body = await response.json()
        assert response.status == 200, body
        expected_echo = {"echo": "abcdefgh", "truncate_prompt_tokens": "fgh"}
        if fields:
            assert body["choices"][0]["text"].startswith(expected_echo[list(fields)[-1]])
        assert not tokenizer.encoded_on_loop
    finally:
        await http.cleanup()
