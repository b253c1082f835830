"""An engine step that does not return: a real instance process whose sim engine takes
4 s a step, watched with a 0.5 s stall timeout. Its stream must end UNAVAILABLE long
before the step returns, it must refuse new work and say NOT_SERVING meanwhile, and once
the step returns it serves again with the abandoned request gone."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc

pytestmark = pytest.mark.timeout(120)

STEP_S = 4.0
STALL_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def instance(tiny_model_dir, tmp_path_factory):
    port = free_port()
    process = ServiceProcess(
        "instance-stall", "instance",
        ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", "stall-0", "--engine", "sim",
         "--sim-step-ms", str(STEP_S * 1000), "--engine-stall-timeout-s", str(STALL_TIMEOUT_S),
         "--num-blocks", "64", "--block-size", "4", "--max-model-len", "256"],
        f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs"))
    process.start()
    asyncio.run(process.wait_healthy(60))
    yield process
    process.stop()


def generate_request(request_id: str) -> instance_pb2.GenerateRequest:
    return instance_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8],
                                        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4))


async def test_a_stalled_step_fails_its_streams_and_the_instance_serves_again_after(instance):
    async with grpc.aio.insecure_channel(instance.address) as channel:
        stub, health = instance_pb2_grpc.InstanceServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.Generate(generate_request("stuck"), timeout=30):
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--engine-stall-timeout-s" in failed.value.details()
        assert time.monotonic() - started < STEP_S  # not when the step returned: when the watchdog saw it
        status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(generate_request("refused"), timeout=5).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        deadline = time.monotonic() + 3 * STEP_S
        serving = health_pb2.HealthCheckResponse.SERVING
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != serving:
            assert time.monotonic() < deadline, "still NOT_SERVING after the step returned"
            await asyncio.sleep(0.1)
        listed = await stub.ListRequests(instance_pb2.ListRequestsRequest(), timeout=10)
        assert list(listed.requests) == []  # the abandoned request was aborted when the step returned


async def test_list_requests_answers_while_a_long_step_runs(instance):
    """Admin reads (the manager locating a request for Migrate) must not wait for a multi-second
    step: after a short wait the instance lists its request table as it is."""
    async with grpc.aio.insecure_channel(instance.address) as channel:
        stub, health = instance_pb2_grpc.InstanceServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        stream = stub.Generate(generate_request("slow"), timeout=30)
        reading = asyncio.ensure_future(stream.read())  # the request is admitted and its step starts
        # Ask until it is listed (a loaded machine admits it late), then on for 0.4 s, while its step runs
        # (the stall watchdog drops it 0.5 s in): every answer must come long before the step returns.
        seen_at, deadline = None, time.monotonic() + 10
        while seen_at is None or time.monotonic() < seen_at + 0.4:
            assert time.monotonic() < deadline, "the request was never listed"
            started = time.monotonic()
            listed = await stub.ListRequests(instance_pb2.ListRequestsRequest(), timeout=STEP_S / 2)
            assert time.monotonic() - started < STEP_S / 2
            if seen_at is None and [r.request_id for r in listed.requests] == ["slow"]:
                seen_at = time.monotonic()
            await asyncio.sleep(0.05)
        stream.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        deadline = time.monotonic() + 3 * STEP_S
        serving = health_pb2.HealthCheckResponse.SERVING
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != serving:
            assert time.monotonic() < deadline, "still NOT_SERVING after the step returned"
            await asyncio.sleep(0.1)
