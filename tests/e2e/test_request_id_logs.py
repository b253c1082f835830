"""One request id, named by the client, can be followed through the frontend, manager, instance and
transfer logs."""

from __future__ import annotations

import json
import pathlib

import aiohttp
import grpc
import pytest

from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from tests.e2e.conftest import launched_cluster

pytestmark = pytest.mark.timeout(180)


def json_lines(path: pathlib.Path) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # non-JSON output (a library's own print)
    return records


async def stream_and_migrate(frontend_url: str, admin_address: str, model: str) -> str:
    # As long as the tiny model's 1024-token context allows, so it still runs when the Migrate lands (on a loaded
    # box the launcher test's 400 tokens took 1.0 s in all)
    body = {"model": model, "prompt": "Follow me through the logs", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{frontend_url}/v1/completions", json=body,
                                headers={"X-Request-Id": "client-trace-1"}) as response:
            request_id = response.headers["x-request-id"]
            assert request_id.startswith("cmpl-client-trace-1-")
            migrated = False
            async for line in response.content:
                if not migrated and line.startswith(b"data: {"):
                    migrated = True
                    async with grpc.aio.insecure_channel(admin_address) as channel:
                        await manager_pb2_grpc.AdminServiceStub(channel).Migrate(
                            manager_pb2.MigrateRequest(request_id=request_id), timeout=30)
    return request_id


async def test_request_id_appears_in_every_services_log(tiny_model_dir, tmp_path):
    state_dir = tmp_path / "cluster"
    with launched_cluster(tiny_model_dir, state_dir, "--instances", "2", "--log-format", "json",
                          "--kv-cache-mib", "16") as cluster:
        request_id = await stream_and_migrate(cluster["frontend_url"], cluster["admin_address"], tiny_model_dir.name)
    # Read once the cluster has stopped: every child wrote its last lines (unbuffered) before it exited.
    seen_in = {path.stem for path in (state_dir / "logs").glob("*.log")
               if any(record.get("request_id") == request_id for record in json_lines(path))}
    assert {"frontend-0", "manager-0", "transfer-0"} <= seen_in, seen_in
    assert {"instance-0", "instance-1"} <= seen_in, seen_in  # source and destination of the migration
