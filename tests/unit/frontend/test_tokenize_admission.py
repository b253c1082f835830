"""/tokenize and /detokenize take a --max-inflight slot each: before, they were not counted, so a
flood of huge tokenize calls (each up to --max-body-bytes, encoded in a thread) was unbounded while
generations got 429s (found by a code review)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from services.frontend.metrics import FrontendMetrics
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)


class HeldTokenizer:
    """Letters a..t; encoding and decoding wait until `release` is set (a huge prompt)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_waiting = 0

    def encode(self, text, add_special_tokens=True):
        self._hold()
        return [ord(c) - ord("a") for c in text]

    def decode(self, token_ids, skip_special_tokens=True):
        self._hold()
        return "".join(chr(ord("a") + t) for t in token_ids)

    def token_bytes(self, token_id):
        return chr(ord("a") + token_id).encode()

    def _hold(self) -> None:
        self.num_waiting += 1
        self.release.wait(10)


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


@pytest.mark.parametrize("held_path, held_body", [("/tokenize", {"model": "m", "prompt": "abc"}),
                                                  ("/detokenize", {"model": "m", "tokens": [0, 1]})])
async def test_a_tokenize_call_holds_a_slot_until_it_ends(held_path, held_body):
    tokenizer = HeldTokenizer()
    async with scripted_frontend(tokenizer=tokenizer, max_inflight=1) as base, aiohttp.ClientSession() as session:
        try:
            held = asyncio.create_task(post(session, base + held_path, held_body))
            while not tokenizer.num_waiting:
                await asyncio.sleep(0.01)
            for path, body in [("/tokenize", {"model": "m", "prompt": "ab"}),
                               ("/detokenize", {"model": "m", "tokens": [0]}),
                               ("/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 1})]:
                status, answer = await post(session, base + path, body)
                assert status == 429 and "--max-inflight" in answer["error"]["message"], (path, answer)
            tokenizer.release.set()
            assert (await held)[0] == 200
            assert (await post(session, base + "/tokenize", {"model": "m", "prompt": "ab"}))[0] == 200  # slot back
        finally:
            tokenizer.release.set()


def in_flight(metrics: FrontendMetrics) -> float:
    return metrics.registry.get_sample_value("ferry_frontend_requests_in_flight")


@pytest.mark.parametrize("held_path, held_body", [("/tokenize", {"model": "m", "prompt": "abc"}),
                                                  ("/detokenize", {"model": "m", "tokens": [0, 1]}),
                                                  ("/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 1})])
async def test_a_client_that_leaves_does_not_free_the_slot_while_its_thread_still_works(held_path, held_body):
    """A client leaving cancels the handler (handler_cancellation), not the tokenizer's thread: before, the
    slot came back at once while the thread went on, so clients that post a huge prompt and hang up were
    as unbounded as before /tokenize was counted (found by a code review)."""
    tokenizer = HeldTokenizer()
    metrics = FrontendMetrics()
    async with scripted_frontend(tokenizer=tokenizer, max_inflight=1, metrics=metrics) as base:
        try:
            async with aiohttp.ClientSession() as session:
                held = asyncio.create_task(post(session, base + held_path, held_body))
                while not tokenizer.num_waiting:
                    await asyncio.sleep(0.01)
            held.cancel()  # the session is closed: the connection goes, the server cancels the handler
            for _ in range(100):  # 1 s for the server to notice, and (before the fix) to give the slot back
                await asyncio.sleep(0.01)
                assert in_flight(metrics) == 1, "the slot came back while the tokenizer's thread still ran"
            tokenizer.release.set()
            for _ in range(500):
                if in_flight(metrics) == 0:
                    break
                await asyncio.sleep(0.01)
            assert in_flight(metrics) == 0  # given back once the thread ended
        finally:
            tokenizer.release.set()
