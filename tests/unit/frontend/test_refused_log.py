"""A request refused before admission (a 400, a 404 model, a 429, ...) is logged once, with the
client's X-Request-Id: before, nothing was logged, so the 4xx an operator saw counted in
ferry_frontend_requests_total could not be found in any log (found by an operator's review)."""

from __future__ import annotations

import aiohttp
import pytest
from structlog.testing import capture_logs

from services.frontend.generation import FinishReason
from services.frontend.metrics import FrontendMetrics
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)


async def test_refusals_are_logged_and_admitted_requests_are_not_logged_as_refused():
    bodies = [({"model": "nope", "prompt": "ab"}, 404), ({"model": "m", "prompt": "ab", "max_tokens": -3}, 400),
              ({"model": "m", "prompt": "ab", "max_tokens": 1}, 200)]
    async with scripted_frontend({"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)}) as base_url:
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as session:
                for n, (body, status) in enumerate(bodies):
                    async with session.post(f"{base_url}/v1/completions", json=body,
                                            headers={"X-Request-Id": f"client-{n}"}) as response:
                        assert response.status == status, await response.text()
    refused = [(e["status"], e["client_request_id"], e["path"]) for e in logs if e["event"] == "request_refused"]
    assert refused == [(404, "client-0", "/v1/completions"), (400, "client-1", "/v1/completions")]
    assert "max_tokens" in [e for e in logs if e["event"] == "request_refused"][1]["error"]


async def test_a_flood_of_refusals_logs_one_line_per_route_and_status_and_counts_them_all():
    """Before, every refused request logged request_refused: a flood of bad clients flooded the log."""
    metrics = FrontendMetrics()
    async with scripted_frontend({}, metrics=metrics, api_keys=("k",)) as base_url:
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as session:
                for n in range(20):
                    async with session.post(f"{base_url}/v1/completions", json={"model": "m", "prompt": "ab"},
                                            headers={"Authorization": f"Bearer wrong-{n}"}) as response:
                        assert response.status == 401
                for path in ("/v1/nothing-here-1", "/v1/nothing-here-2"):  # unmatched routes share one key
                    async with session.get(f"{base_url}{path}") as response:
                        assert response.status == 401
    refused = [(e["path"], e["status"], e["suppressed"]) for e in logs if e["event"] == "request_refused"]
    assert refused == [("/v1/completions", 401, 0), ("/v1/nothing-here-1", 401, 0)]
    assert metrics.requests.labels("/v1/completions", "401")._value.get() == 20
