"""A non-streaming answer is built and encoded off the event loop: 8 choices of 1000 tokens with
20 top logprobs took the loop for 1.1 s on the tiny model, stalling every other stream, /health
and the frontend's etcd lease keep-alive (its lease expired under such load; found by
black-box check #3)."""

from __future__ import annotations

import threading

import aiohttp
import pytest

from services.frontend import openai_response
from services.frontend.generation import FinishReason
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)


async def test_the_json_answer_is_built_off_the_event_loop(monkeypatch):
    threads: list[threading.Thread] = []
    build = openai_response.ResponseFormatter.response

    def noting_thread(self, states, choices):
        threads.append(threading.current_thread())
        return build(self, states, choices)
    monkeypatch.setattr(openai_response.ResponseFormatter, "response", noting_thread)
    async with scripted_frontend({"a": ([chunk(0, 1, 2, finish=FinishReason.LENGTH)], None)}) as base_url:
        async with aiohttp.ClientSession() as session, session.post(
                f"{base_url}/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2}) as response:
            body = await response.json()
    assert response.status == 200, body
    assert body["choices"][0]["text"] == "bc"
    assert threads and threading.main_thread() not in threads
