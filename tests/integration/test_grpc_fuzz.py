"""Every gRPC service survives garbage: random bytes, truncated messages and hostile field
values sent to each method of the instance, the manager (ManagerService + AdminService)
and the transfer service. Nothing may crash a handler (INTERNAL/UNKNOWN), undecodable
bytes get INVALID_ARGUMENT, and afterwards each service still answers health and a valid
call."""

from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import (common_pb2, instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc,
                                          transfer_pb2, transfer_pb2_grpc)
from services.common.grpc_server import insecure_channel
from tests.integration.grpc_fuzz import CRASH_CODES, Outcome, fuzz_service

pytestmark = pytest.mark.timeout(300)

SEED = 6
NUM_EACH = 6  # payloads of each kind per method


@pytest.fixture(scope="module")
def cluster_name() -> str:
    return f"fuzz-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def processes(etcd, tiny_model_dir, cluster_name, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    ports = {name: free_port() for name in ("instance", "manager", "transfer")}
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster_name]
    started = {
        "manager": ServiceProcess("manager", "manager", ["--port", str(ports["manager"]), *common],
                                  f"127.0.0.1:{ports['manager']}", log_dir),
        "transfer": ServiceProcess("transfer", "transfer", ["--port", str(ports["transfer"]), "--transfer-id", "t0",
                                                            *common], f"127.0.0.1:{ports['transfer']}", log_dir),
        "instance": ServiceProcess(
            "instance", "instance",
            ["--model", str(tiny_model_dir), "--port", str(ports["instance"]), "--instance-id", "i0",
             "--num-threads", "1", "--num-blocks", "64", "--block-size", "4", "--max-model-len", "128",
             "--lease-ttl-s", "3", *common], f"127.0.0.1:{ports['instance']}", log_dir),
    }
    try:
        for process in started.values():
            process.start()
        for process in started.values():
            asyncio.run(process.wait_healthy(90))
        yield started
    finally:
        stop_all(started.values())


def _crashes(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.code in CRASH_CODES]


async def _healthy(channel: grpc.aio.Channel) -> bool:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _fuzz(address: str, service_names: list[tuple[object, str]], skip=()) -> list[Outcome]:
    rng = random.Random(SEED)
    outcomes = []
    async with insecure_channel(address) as channel:
        for module, name in service_names:
            outcomes += await fuzz_service(channel, module.DESCRIPTOR.services_by_name[name], rng, NUM_EACH, skip=skip)
        assert await _healthy(channel)
    return outcomes


def _assert_no_crash(outcomes: list[Outcome]) -> None:
    crashes = _crashes(outcomes)
    assert not crashes, "\n".join(f"{o.method} {o.kind}: {o.code.name} {o.details}" for o in crashes[:20])
    undecodable = [o for o in outcomes if not o.is_decodable]
    assert undecodable, "the fuzzer sent no undecodable bytes"
    assert all(o.code is grpc.StatusCode.INVALID_ARGUMENT and "cannot be decoded" in o.details
               for o in undecodable), [o for o in undecodable if o.code is not grpc.StatusCode.INVALID_ARGUMENT][:5]
    rejected = [o for o in outcomes if o.code is grpc.StatusCode.INVALID_ARGUMENT]
    assert all(o.details for o in rejected), "an INVALID_ARGUMENT without a message"


async def test_instance_survives_fuzzing(processes):
    address = processes["instance"].address
    outcomes = await _fuzz(address, [(instance_pb2, "InstanceService")])
    _assert_no_crash(outcomes)
    assert any(o.code is grpc.StatusCode.INVALID_ARGUMENT for o in outcomes)
    async with insecure_channel(address) as channel:
        stub = instance_pb2_grpc.InstanceServiceStub(channel)
        await stub.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_BOTH), timeout=10)  # fuzzing may flip it
        request = instance_pb2.GenerateRequest(request_id=f"valid-{uuid.uuid4().hex[:6]}", prompt_token_ids=[5, 17, 42],
                                               sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
        chunks = [chunk async for chunk in stub.Generate(request, timeout=30)]
        assert sum(len(c.token_ids) for c in chunks) == 4
    assert processes["instance"].is_alive()


async def test_manager_survives_fuzzing(processes):
    address = processes["manager"].address
    outcomes = await _fuzz(address, [(manager_pb2, "ManagerService"), (manager_pb2, "AdminService")])
    _assert_no_crash(outcomes)
    async with insecure_channel(address) as channel:
        admin = manager_pb2_grpc.AdminServiceStub(channel)
        await admin.GetPolicy(manager_pb2.GetPolicyRequest(), timeout=5)
        reply = await admin.ListInstances(manager_pb2.ListInstancesRequest(), timeout=5)
        assert any(i.instance_id == "i0" for i in reply.instances)
    assert processes["manager"].is_alive()


async def test_transfer_survives_fuzzing(processes):
    address = processes["transfer"].address
    outcomes = await _fuzz(address, [(transfer_pb2, "TransferService")])
    _assert_no_crash(outcomes)
    async with insecure_channel(address) as channel:
        reply = await transfer_pb2_grpc.TransferServiceStub(channel).GetStatus(
            transfer_pb2.GetTransferStatusRequest(), timeout=5)
        assert reply.transfer_id == "t0"
    assert processes["transfer"].is_alive()
