"""Priority headroom end to end: a manager and two sim-engine instances that keep
--priority-headroom-blocks out of their freeness for each request with priority > 0. While
one instance serves a high-priority request, the manager sends new requests to the other."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.ctl.client import AdminClient
from services.manager.client import ManagerClient

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 256
HEADROOM_BLOCKS = 200  # of 256: an instance with one high-priority request looks nearly full
INSTANCE_IDS = ("hr-0", "hr-1")
READY_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def cluster(etcd, tiny_model_dir, tmp_path_factory):
    name = f"hr-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path_factory.mktemp("logs")
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", name, "--lease-ttl-s", "3"]
    manager_port = free_port()
    manager = ServiceProcess("manager-hr", "manager", ["--port", str(manager_port), "--manager-id", "manager-hr",
                                                       *common], f"127.0.0.1:{manager_port}", log_dir)
    instances = [_instance(instance_id, tiny_model_dir, common, log_dir) for instance_id in INSTANCE_IDS]
    processes = [manager, *instances]
    try:
        for process in processes:
            process.start()
        for process in processes:
            asyncio.run(process.wait_healthy(READY_TIMEOUT_S))
        yield manager.address, {i: p.address for i, p in zip(INSTANCE_IDS, instances)}
    finally:
        stop_all(processes)


def _instance(instance_id, model_dir, common, log_dir) -> ServiceProcess:
    port = free_port()
    args = ["--model", str(model_dir), "--port", str(port), "--instance-id", instance_id, "--num-threads", "1",
            "--num-blocks", str(NUM_BLOCKS), "--block-size", "4", "--max-model-len", "1024", "--engine", "sim",
            "--sim-step-ms", "20", "--priority-headroom-blocks", str(HEADROOM_BLOCKS), *common]
    return ServiceProcess(instance_id, "instance", args, f"127.0.0.1:{port}", log_dir)


async def rows_when(admin: AdminClient, is_ready) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        rows = {row.instance_id: row for row in await admin.list_instances()}
        if is_ready(rows):
            return rows
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the manager never showed what was expected: {rows}")


@contextlib.asynccontextmanager
async def generating(address: str, priority: int):
    """A long sim-engine generation (20 ms a step, 900 tokens) on one instance, cancelled on exit."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = instance_pb2_grpc.InstanceServiceStub(channel).Generate(instance_pb2.GenerateRequest(
            request_id=f"hr-{uuid.uuid4().hex[:8]}", prompt_token_ids=[5, 17, 42, 99, 7, 3], priority=priority,
            sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)), timeout=60)
        await call.read()  # running now
        try:
            yield
        finally:
            call.cancel()


async def test_new_requests_go_around_an_instance_serving_a_high_priority_request(cluster):
    manager_address, addresses = cluster
    busy, other = INSTANCE_IDS
    async with AdminClient(manager_address, timeout_s=5.0) as admin, \
            ManagerClient(manager_address, timeout_s=5.0) as manager:
        await rows_when(admin, lambda rows: all(rows.get(i) and rows[i].state == "serving" for i in INSTANCE_IDS))
        async with generating(addresses[busy], priority=1):
            rows = await rows_when(admin, lambda rows: rows[busy].num_running == 1)
            assert rows[busy].freeness < (NUM_BLOCKS - HEADROOM_BLOCKS) / 2  # the headroom is not free
            placements = [await manager.dispatch(f"d-{n}", num_prompt_tokens=12, max_tokens=40) for n in range(4)]
            assert [p.instance_id for p in placements] == [other] * 4
        # a normal request leaves no headroom: both instances are as free as their blocks say
        async with generating(addresses[busy], priority=0):
            rows = await rows_when(admin, lambda rows: rows[busy].num_running == 1)
            assert rows[busy].freeness > (NUM_BLOCKS - HEADROOM_BLOCKS) / 2
