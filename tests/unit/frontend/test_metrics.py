"""The frontend's token counters: prompt and output tokens, the throughput an operator asks for
(before, no metric counted tokens: TTFT and ITL gave latency, nothing gave tokens per second)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from services.common.errors import InvalidArgument
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import FinishReason
from services.frontend.metrics import FrontendMetrics
from services.frontend.openai_response import ResponseFormatter
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, chunk, entry
from tests.unit.frontend.test_tokenize_off_loop import ThreadNotingTokenizer

pytestmark = pytest.mark.timeout(30)


def sample(metrics: FrontendMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_prompt_and_generation_tokens_are_counted():
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1, 2), chunk(2, 3, finish=FinishReason.LENGTH)], None)})
    metrics = FrontendMetrics()
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            metrics, api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions",
                json={"model": "m", "prompt": "abcdefgh", "max_tokens": 3}) as response:
            body = await response.json()
        assert response.status == 200, body
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        assert sample(metrics, "ferry_frontend_prompt_tokens_total") == 8
        assert sample(metrics, "ferry_frontend_generation_tokens_total") == 3
        assert sample(metrics, "ferry_frontend_time_to_first_token_seconds_count") == 1
        assert sample(metrics, "ferry_frontend_inter_token_latency_seconds_count") == 2
    finally:
        await http.cleanup()


async def test_a_stream_that_fails_after_its_200_is_counted_as_a_stream_error():
    """ferry_frontend_requests_total counts such a stream as 200: before, no metric showed the
    streams that ended with an error event, only the stream_failed log line."""
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1)], InvalidArgument("the instance refused it"))})
    metrics = FrontendMetrics()
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            metrics, api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions",
                json={"model": "m", "prompt": "ab", "max_tokens": 3, "stream": True}) as response:
            body = await response.text()
        assert response.status == 200 and "the instance refused it" in body, body
        assert sample(metrics, "ferry_frontend_stream_errors_total", {"status": "400"}) == 1
    finally:
        await http.cleanup()


async def test_a_stream_that_crashes_after_its_200_is_counted_as_a_stream_error_500():
    """A bug after the 200 also ends the stream with an error event (a 500's): before, only the
    FerryError path counted, so the metric missed exactly the streams that a bug broke."""
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1)], None)})
    metrics = FrontendMetrics()
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            metrics, api_keys=(), max_inflight=8, max_body_bytes=1 << 20)

    def crash(*args, **kwargs):
        raise RuntimeError("a bug in the formatter")
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ResponseFormatter, "chunk", crash)
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions",
                    json={"model": "m", "prompt": "ab", "max_tokens": 3, "stream": True}) as response:
                body = await response.text()
        assert response.status == 200 and "internal error" in body, body
        assert sample(metrics, "ferry_frontend_stream_errors_total", {"status": "500"}) == 1
    finally:
        await http.cleanup()
