"""benchmarks/serving.py reads a stream as the frontend writes it (services/frontend/answer.py): after the
200 an error ends the stream with an error event (`data: {"error": ...}`) and then `data: [DONE]`. That
event is a failed request, never a token, so the run's figures leave the request out and the run fails.
A stream that ends without `data: [DONE]` (the connection cut, the frontend crashed) failed as well: it
is no success with fewer tokens."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from tests.loopback_http import served_on_loopback
from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(60)

TOKEN = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
ERROR = {"error": {"message": "instance lost its lease", "type": "ServiceUnavailableError", "code": 503}}


def streaming(*payloads: dict, ending: str = "done") -> web.Application:
    """Writes `payloads` as SSE events, then ends the stream: "done" with `data: [DONE]`, "closed" without it
    (a well-formed end, as a proxy would give when its upstream died), "cut" by dropping the connection."""
    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for payload in payloads:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        if ending == "done":
            await response.write(b"data: [DONE]\n\n")
        elif ending == "cut":
            request.transport.close()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def sent(monkeypatch, *payloads: dict, ending: str = "done"):
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    async with served_on_loopback(streaming(*payloads, ending=ending)) as url, aiohttp.ClientSession() as session:
        return await serving.send(session, url, "m", [1, 2, 3], 4)


async def test_an_error_event_fails_the_request_and_is_no_token(monkeypatch):
    result = await sent(monkeypatch, TOKEN, TOKEN, ERROR)
    assert "instance lost its lease" in result.error
    assert result.num_tokens == 2 and len(result.itl_ms) == 1


async def test_a_stream_of_tokens_counts_each(monkeypatch):
    result = await sent(monkeypatch, TOKEN, TOKEN, TOKEN)
    assert result.error == "" and result.num_tokens == 3 and len(result.itl_ms) == 2


async def test_a_stream_that_ends_without_done_fails_the_request(monkeypatch):
    result = await sent(monkeypatch, TOKEN, TOKEN, ending="closed")
    assert "truncated" in result.error and "after 2 tokens" in result.error, result.error


async def test_a_cut_connection_fails_the_request(monkeypatch):
    result = await sent(monkeypatch, TOKEN, TOKEN, ending="cut")
    assert result.error.startswith("ClientPayloadError") and result.num_tokens == 2

