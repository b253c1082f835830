"""A request refused before admission (a 400, a 404 model, a 429, ...) is logged once, with the
client's X-Request-Id: before, nothing was logged, so the 4xx an operator saw counted in
ferry_frontend_requests_total could not be found in any log (found by an operator's review)."""

from __future__ import annotations

import aiohttp
import pytest
from structlog.testing import capture_logs

from services.frontend.generation import FinishReason
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
