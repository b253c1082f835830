"""A request whose instance dies during its prefill resumes elsewhere with the bits it would have had:
the frontend's HTTP server, dispatcher and gRPC clients in this process, two real instance processes
(the tiny model), a scripted manager that places requests where the test says."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from services.cluster.processes import ServiceProcess
from services.common.errors import Unavailable
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.common.grpc_server import start_grpc_server
from services.frontend.dispatch import Dispatcher, InstanceEntry
from services.frontend.generation import InstanceId
from services.frontend.instance_client import InstanceClients
from services.frontend.manager_client import ManagerClient, StaticLeader
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.loopback_http import served_on_loopback
from tests.unit.frontend.factories import FakeMembership

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
SHARED = [(7 * i + 3) % 500 + 1 for i in range(145)]  # its first 144 tokens: 9 blocks of 16
PROMPT = SHARED[:144] + [(11 * i + 5) % 500 + 1 for i in range(856)]  # 1000 tokens: chunks of 240 after 144


@pytest.fixture(scope="module")
def instances(tiny_model_dir, tmp_path_factory):
    processes = {}
    for name in ("a", "b"):
        port = free_port()
        processes[name] = ServiceProcess(
            f"instance-{name}", "instance",
            ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", name, "--num-threads", "1",
             "--block-size", "16", "--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "512"],
            f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs"))
        processes[name].start()
    for process in processes.values():
        asyncio.run(process.wait_healthy(60))
    yield processes
    for process in processes.values():
        process.stop()


class PlacingManager(manager_pb2_grpc.ManagerServiceServicer):
    """Dispatch answers `prefer` unless the frontend excludes it, then the other instance."""

    def __init__(self, entries: list[InstanceEntry]) -> None:
        self.entries = entries
        self.prefer = entries[0].instance_id

    async def Dispatch(self, request, context):
        entry = next(e for e in sorted(self.entries, key=lambda e: e.instance_id != self.prefer)
                     if e.instance_id not in request.exclude_instance_ids)
        return manager_pb2.DispatchResponse(instance_id=entry.instance_id, address=entry.address, policy="test")


class WatchedClients(InstanceClients):
    """The frontend's instance clients; `on_chunk(instance_id, chunk)` sees every Generate chunk first. Once
    it returns True the stream breaks there (as it does when the instance dies: chunks the dead instance had
    sent may still be read first, and this test wants none after its first)."""

    on_chunk = staticmethod(lambda instance_id, chunk: False)

    async def generate(self, target, spec):
        async for chunk in super().generate(target, spec):
            is_cut = self.on_chunk(target.instance_id, chunk)
            yield chunk
            if is_cut:
                raise Unavailable(f"instance {target.instance_id} was killed")


async def complete(base_url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base_url}/v1/completions", json={"model": MODEL, **body}) as response:
            assert response.status == 200, await response.text()
            return json.loads(await response.read())


async def test_a_request_whose_instance_dies_during_its_prefill_resumes_with_its_bits(instances, tiny_model_dir):
    """r's 1000-token prompt starts after a 144-token prefix another request left in the cache, so its prompt
    is cut at 144 and then every 240 tokens. Reference: r on a. Then the same on b (salted, so a's cache holds
    nothing of it), b killed (SIGKILL) at its first chunk for r, which has no token but says where r started
    (its prefill has four more steps to go); the frontend resumes r on a, which cuts the prompt there again:
    the same tokens and logprobs to the bit. Before, b's first chunk carried r's first token (this test fails
    there); a resume sending no first_start computes the prompt from 0 in chunks of 240: other logprobs
    (from token 1 here)."""
    entries = [InstanceEntry(InstanceId(n), p.address, True) for n, p in instances.items()]
    manager = PlacingManager(entries)
    server = await start_grpc_server("127.0.0.1", 0, [(manager_pb2_grpc.add_ManagerServiceServicer_to_server, manager)],
                                     ["ferry.v1.ManagerService"])
    clients = WatchedClients(generate_timeout_s=60, abort_timeout_s=2)
    metrics = FrontendMetrics()
    manager_client = ManagerClient(StaticLeader(server.address), timeout_s=5)
    dispatcher = Dispatcher(manager_client, FakeMembership(*entries), cooldown_s=5.0)
    runner = RequestRunner(dispatcher, clients, max_resumes=2, on_resume=metrics.resumes.inc)
    model = ServedModel.load(tiny_model_dir, MODEL, max_model_len=1024)
    app = FrontendServer(model, runner, dispatcher, metrics, api_keys=(), max_inflight=8, max_body_bytes=1 << 20).app()
    sampling = {"max_tokens": 6, "temperature": 0.9, "top_p": 0.95, "seed": 77, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
    try:
        async with served_on_loopback(app) as base_url:
            await complete(base_url, {"prompt": SHARED, "max_tokens": 1})
            reference = (await complete(base_url, {"prompt": PROMPT, **sampling}))["choices"][0]
            manager.prefer = "b"
            salted = {**sampling, "cache_salt": "killed"}
            await complete(base_url, {"prompt": SHARED, "max_tokens": 1, "cache_salt": "killed"})
            seen_from_b = []

            def kill_b_at_its_first_chunk(instance_id, chunk) -> bool:
                if instance_id != "b":
                    return False
                seen_from_b.append((list(chunk.token_ids), chunk.first_start))
                instances["b"].kill()
                return True

            clients.on_chunk = kill_b_at_its_first_chunk
            resumed = (await complete(base_url, {"prompt": PROMPT, **salted}))["choices"][0]
            assert seen_from_b == [([], 144)]  # no token yet: b died during the prefill
            assert metrics.resumes._value.get() == 1
            assert resumed["token_ids"] == reference["token_ids"]
            assert resumed["logprobs"]["token_logprobs"] == reference["logprobs"]["token_logprobs"]
    finally:
        await clients.close()
        await manager_client.close()
        await server.stop(0)
