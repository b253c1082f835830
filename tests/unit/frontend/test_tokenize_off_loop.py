"""Tokenizing a prompt runs off the event loop, echo included: a 1 MB prompt with `echo` and
`truncate_prompt_tokens` was encoded a second time on the loop and stalled every stream of the
frontend for about 0.45 s (found by review)."""

from __future__ import annotations

import aiohttp
import pytest

from services.frontend.generation import FinishReason
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import ThreadNotingTokenizer, scripted_frontend

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("fields", [{}, {"echo": True}, {"echo": True, "truncate_prompt_tokens": 3}])
async def test_no_prompt_is_encoded_on_the_event_loop(fields):
    tokenizer = ThreadNotingTokenizer()
    async with scripted_frontend({"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)},
                                 tokenizer=tokenizer) as base_url:
        async with aiohttp.ClientSession() as session, session.post(
                f"{base_url}/v1/completions",
                json={"model": "m", "prompt": "abcdefgh", "max_tokens": 1, **fields}) as response:
            body = await response.json()
    assert response.status == 200, body
    expected_echo = {"echo": "abcdefgh", "truncate_prompt_tokens": "fgh"}
    if fields:
        assert body["choices"][0]["text"].startswith(expected_echo[list(fields)[-1]])
    assert not tokenizer.encoded_on_loop
