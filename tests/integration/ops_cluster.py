"""A small real cluster for the operator tests (ferryctl, grpcurl.md): a manager process
and one instance process on a tiny model, both on the module's etcd, started the way an
operator starts them (`python -m services.<name>`), stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.ctl.client import AdminClient

INSTANCE_ID = "instance-0"  # the id deploy/grpcurl.md uses
READY_TIMEOUT_S = 90.0


@dataclass
class OpsCluster:
    admin_address: str
    instance_address: str
    instance_id: str
    processes: list[ServiceProcess]

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.processes)


@contextlib.contextmanager
def ops_cluster(etcd: LocalEtcd, model_dir: pathlib.Path, log_dir: pathlib.Path) -> Iterator[OpsCluster]:
    cluster = f"ops-{uuid.uuid4().hex[:8]}"
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--lease-ttl-s", "3"]
    manager_port, instance_port = free_port(), free_port()
    manager = ServiceProcess("manager-0", "manager", ["--port", str(manager_port), "--manager-id", "manager-0",
                                                      *common], f"127.0.0.1:{manager_port}", log_dir)
    instance = ServiceProcess(
        INSTANCE_ID, "instance",
        ["--model", str(model_dir), "--port", str(instance_port), "--instance-id", INSTANCE_ID, "--num-threads", "1",
         "--num-blocks", "256", "--block-size", "4", "--max-model-len", "1024", *common],
        f"127.0.0.1:{instance_port}", log_dir)
    ops = OpsCluster(manager.address, instance.address, INSTANCE_ID, [manager, instance])
    try:
        for process in ops.processes:
            process.start()
            asyncio.run(process.wait_healthy(READY_TIMEOUT_S))
        asyncio.run(_wait_serving(ops))
        yield ops
    finally:
        for process in reversed(ops.processes):
            process.stop()


async def _wait_serving(ops: OpsCluster) -> None:
    """Until the leader lists the instance as serving (its load reports arrive)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with AdminClient(ops.admin_address, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            rows = await client.list_instances()
            if any(r.instance_id == ops.instance_id and r.state == "serving" for r in rows):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{ops.instance_id} never became serving at the manager\n{ops.log_tails()}")


@contextlib.contextmanager
def running_request(instance_address: str, max_tokens: int = 900) -> Iterator[str]:
    """A long greedy generation on the instance, read in a thread; cancelled on exit."""
    request_id = f"ops-{uuid.uuid4().hex[:8]}"
    channel = grpc.insecure_channel(instance_address)
    request = instance_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 17, 42, 99, 7, 3],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    stream = instance_pb2_grpc.InstanceServiceStub(channel).Generate(request, timeout=120)
    started = threading.Event()

    def drain() -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in stream:
                started.set()
        started.set()

    reader = threading.Thread(target=drain, name=f"read-{request_id}", daemon=True)
    reader.start()
    started.wait(30)
    try:
        yield request_id
    finally:
        stream.cancel()
        reader.join(10)
        channel.close()
