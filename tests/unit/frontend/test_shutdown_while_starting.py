"""SIGTERM while an admitted request is still tokenizing: the grace waits for it as for a running
one, and a request only ready after the grace gets a 503 instead of a body cut mid-way."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from services.common.errors import Unavailable
from services.frontend.dispatch import Dispatcher, InstanceEntry
from services.frontend.generation import FinishReason, InstanceId
from services.frontend.in_flight import InFlight
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, chunk, entry, make_state

pytestmark = pytest.mark.timeout(30)


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 20 for c in text]

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()


class SlowTokenizing(ServedModel):
    """Tokenizing takes until TOKENIZED is set (a long prompt, a heavy chat template)."""

    def prepared_prompts(self, parsed):
        TOKENIZED.wait(10)
        return ServedModel.prepared_prompts(self, parsed)


TOKENIZED = threading.Event()


class EndlessInstances(ScriptedInstances):
    async def generate(self, target, spec):
        for i in range(10_000):
            yield chunk(i, 1)
            await asyncio.sleep(0.02)


async def serve_one_stream(grace_s: float, tokenized_after_s: float) -> tuple[float, int, bytes]:
    """A stream admitted just before the shutdown, whose tokenizing ends `tokenized_after_s` into it:
    (how long the grace waited, the HTTP status, the body)."""
    model = SlowTokenizing("m", max_model_len=100_000, vocab_size=32, tokenizer=CharTokenizer())
    TOKENIZED.clear()
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    server = FrontendServer(model, RequestRunner(dispatcher, EndlessInstances({}), max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions"

    async def client() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"model": "m", "prompt": "abc", "max_tokens": 5000,
                                               "stream": True}) as response:
                return response.status, await response.read()

    answer = asyncio.create_task(client())
    await asyncio.sleep(0.3)  # admitted, tokenizing
    server.is_accepting = False  # serve()'s shutdown: stop accepting, give the grace, then clean up
    asyncio.get_running_loop().call_later(tokenized_after_s, TOKENIZED.set)
    started = time.monotonic()
    await server.in_flight.finish_or_cut(grace_s)
    waited = time.monotonic() - started
    TOKENIZED.set()
    await asyncio.sleep(0.3)
    await http.cleanup()
    status, body = await asyncio.wait_for(answer, 10)
    return waited, status, body


async def test_a_request_tokenizing_at_the_shutdown_gets_the_grace_and_a_clean_cut():
    waited, status, body = await serve_one_stream(grace_s=1.5, tokenized_after_s=0.3)
    assert waited >= 1.4  # it was waited for, not missed
    assert status == 200 and b"\"text_completion\"" in body
    assert b"shutting down" in body and body.endswith(b"data: [DONE]\n\n")


async def test_a_request_still_tokenizing_after_the_grace_is_refused_with_a_503():
    waited, status, body = await serve_one_stream(grace_s=0.5, tokenized_after_s=5.0)
    assert waited >= 0.45
    assert status == 503 and b"grace (--shutdown-grace-s) has passed" in body


async def test_starting_requests_hold_the_grace_and_none_serves_after_it():
    in_flight = InFlight()
    with in_flight.starting():
        started = time.monotonic()
        assert await in_flight.finish_or_cut(0.3) == 0
        assert time.monotonic() - started >= 0.25
        with pytest.raises(Unavailable, match="grace"), in_flight.serving([make_state()], []):
            pass


async def test_truncate_prompt_tokens_minus_one_keeps_what_the_served_context_holds():
    """-1 cut the prompt to config.json's context (1000 here), not to the 60 tokens the instances'
    KV caches serve, so a prompt longer than those was refused instead of cut (black-box run)."""
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=CharTokenizer())
    instance = InstanceEntry(InstanceId("a"), "addr-a", True, max_model_len=60)
    dispatcher = Dispatcher(None, FakeMembership(instance), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)})
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": "x" * 200, "max_tokens": 1, "truncate_prompt_tokens": -1}
            async with session.post(f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions", json=body) as response:
                answer = await response.json()
        assert response.status == 400 and "the prompt is 60 tokens" in answer["error"]["message"], answer
    finally:
        await http.cleanup()
