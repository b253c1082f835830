"""A request refused before admission (a 400, a 404 model, a 429, ...) is logged once, with the
client's X-Request-Id: before, nothing was logged, so the 4xx an operator saw counted in
ferry_frontend_requests_total could not be found in any log (found by an operator's review)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from services.frontend.dispatch import Dispatcher
from services.frontend.generation import FinishReason
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, chunk, entry
from tests.unit.frontend.test_tokenize_off_loop import ThreadNotingTokenizer

pytestmark = pytest.mark.timeout(30)


async def test_refusals_are_logged_and_admitted_requests_are_not_logged_as_refused():
    model = ServedModel("m", max_model_len=1000, vocab_size=32, tokenizer=ThreadNotingTokenizer())
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instances = ScriptedInstances({"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)})
    server = FrontendServer(model, RequestRunner(dispatcher, instances, max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    http = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await http.setup()
    await web.TCPSite(http, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{http.addresses[0][1]}/v1/completions"
    bodies = [({"model": "nope", "prompt": "ab"}, 404), ({"model": "m", "prompt": "ab", "max_tokens": -3}, 400),
              ({"model": "m", "prompt": "ab", "max_tokens": 1}, 200)]
    try:
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as session:
                for n, (body, status) in enumerate(bodies):
                    async with session.post(url, json=body, headers={"X-Request-Id": f"client-{n}"}) as response:
                        assert response.status == status, await response.text()
    finally:
        await http.cleanup()
    refused = [(e["status"], e["client_request_id"], e["path"]) for e in logs if e["event"] == "request_refused"]
    assert refused == [(404, "client-0", "/v1/completions"), (400, "client-1", "/v1/completions")]
    assert "max_tokens" in [e for e in logs if e["event"] == "request_refused"][1]["error"]
