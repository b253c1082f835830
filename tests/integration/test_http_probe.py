"""The launcher's readiness probe of a frontend counts only a ferry frontend's /health: etcd's own
/health once answered it on a port the frontend could not bind (found by a black-box run)."""

from __future__ import annotations

import urllib.request

import pytest
from aiohttp import web

from services.cluster.processes import _http_healthy
from services.common.etcd_launcher import free_port

pytestmark = pytest.mark.timeout(30)


async def test_etcds_health_endpoint_is_not_a_frontend(etcd):
    with urllib.request.urlopen(f"http://{etcd.endpoint}/health", timeout=5) as response:
        assert response.status == 200  # etcd answers /health itself
    assert not await _http_healthy(f"http://{etcd.endpoint}")


@pytest.mark.parametrize("body, status, healthy", [
    ({"status": "ok", "num_instances": 2}, 200, True),
    ({"status": "no_instances", "num_instances": 0}, 503, False),
    ({"health": "true"}, 200, False),
])
async def test_only_a_frontends_ok_counts(body, status, healthy):
    async def health(_request: web.Request) -> web.Response:
        return web.json_response(body, status=status)
    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        assert await _http_healthy(f"http://127.0.0.1:{port}") is healthy
    finally:
        await runner.cleanup()
