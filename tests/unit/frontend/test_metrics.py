"""The frontend's token counters: prompt and output tokens, the throughput an operator asks for
(before, no metric counted tokens: TTFT and ITL gave latency, nothing gave tokens per second)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from services.common.errors import InvalidArgument
from services.frontend.generation import FinishReason
from services.frontend.metrics import FrontendMetrics
from services.frontend.openai_response import ResponseFormatter
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)


def sample(metrics: FrontendMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def post_completion(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.text()


async def test_prompt_and_generation_tokens_are_counted():
    metrics = FrontendMetrics()
    answer = [chunk(0, 1, 2), chunk(2, 3, finish=FinishReason.LENGTH)]
    async with scripted_frontend({"a": (answer, None)}, metrics=metrics) as url:
        status, body = await post_completion(url, {"model": "m", "prompt": "abcdefgh", "max_tokens": 3})
    assert status == 200, body
    assert json.loads(body)["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
    assert sample(metrics, "ferry_frontend_prompt_tokens_total") == 8
    assert sample(metrics, "ferry_frontend_generation_tokens_total") == 3
    assert sample(metrics, "ferry_frontend_time_to_first_token_seconds_count") == 1
    assert sample(metrics, "ferry_frontend_inter_token_latency_seconds_count") == 2


async def test_a_stream_that_fails_after_its_200_is_counted_as_a_stream_error():
    """ferry_frontend_requests_total counts such a stream as 200: before, no metric showed the
    streams that ended with an error event, only the stream_failed log line."""
    metrics = FrontendMetrics()
    async with scripted_frontend({"a": ([chunk(0, 1)], InvalidArgument("the instance refused it"))},
                                 metrics=metrics) as url:
        status, body = await post_completion(url, {"model": "m", "prompt": "ab", "max_tokens": 3, "stream": True})
    assert status == 200 and "the instance refused it" in body, body
    assert sample(metrics, "ferry_frontend_stream_errors_total", {"status": "400"}) == 1


async def test_a_stream_that_crashes_after_its_200_is_counted_as_a_stream_error_500():
    """A bug after the 200 also ends the stream with an error event (a 500's): before, only the
    FerryError path counted, so the metric missed exactly the streams that a bug broke."""
    metrics = FrontendMetrics()

    def crash(*args, **kwargs):
        raise RuntimeError("a bug in the formatter")
    async with scripted_frontend({"a": ([chunk(0, 1)], None)}, metrics=metrics) as url:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ResponseFormatter, "chunk", crash)
            status, body = await post_completion(url, {"model": "m", "prompt": "ab", "max_tokens": 3, "stream": True})
    assert status == 200 and "internal error" in body, body
    assert sample(metrics, "ferry_frontend_stream_errors_total", {"status": "500"}) == 1
