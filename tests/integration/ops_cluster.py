"""A small real cluster for the operator tests (ferryctl, grpcurl.md): a manager, a
transfer service and two instances on a tiny model, all on the module's etcd, started the
way an operator starts them (`python -m services.<name>`), stopped by PID.

The instances run the sim engine (8 ms a step at least): the operator commands need a
request that is still running when they arrive, and the tiny model's real forward pass
finishes 1000 tokens in about a second, sooner than a ferryctl process starts on a busy
machine.
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

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.ctl.client import AdminClient
from services.instance.config import InstanceConfig

INSTANCE_ID, OTHER_INSTANCE_ID = "instance-0", "instance-1"  # the ids deploy/grpcurl.md uses
READY_TIMEOUT_S = 90.0


@dataclass
class OpsCluster:
    admin_address: str
    instance_address: str  # of INSTANCE_ID
    instance_id: str
    processes: list[ServiceProcess]
    transfer_address: str = ""

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.processes)


@contextlib.contextmanager
def ops_cluster(etcd: LocalEtcd, model_dir: pathlib.Path, log_dir: pathlib.Path) -> Iterator[OpsCluster]:
    cluster = f"ops-{uuid.uuid4().hex[:8]}"
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--lease-ttl-s", "3"]
    manager_port, transfer_port = free_port(), free_port()
    manager = ServiceProcess("manager-0", "manager", ["--port", str(manager_port), "--manager-id", "manager-0",
                                                      *common], f"127.0.0.1:{manager_port}", log_dir)
    transfer = ServiceProcess("transfer-0", "transfer", ["--port", str(transfer_port), "--transfer-id", "transfer-0",
                                                         *common], f"127.0.0.1:{transfer_port}", log_dir)
    instances = [_instance(i, model_dir, transfer.address, common, log_dir) for i in (INSTANCE_ID, OTHER_INSTANCE_ID)]
    ops = OpsCluster(manager.address, instances[0].address, INSTANCE_ID, [manager, transfer, *instances],
                     transfer.address)
    try:
        for group in ([manager, transfer], instances):
            for process in group:
                process.start()
            for process in group:
                asyncio.run(process.wait_healthy(READY_TIMEOUT_S))
        asyncio.run(_wait_serving(ops))
        yield ops
    finally:
        stop_all(ops.processes)


def _instance(instance_id: str, model_dir: pathlib.Path, transfer_address: str, common: list[str],
              log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    args = ["--model", str(model_dir), "--port", str(port), "--instance-id", instance_id, "--num-threads", "1",
            "--num-blocks", "256", "--block-size", "4", "--max-model-len", "1024", "--engine", "sim", *common]
    if "transfer_address" in InstanceConfig.__dataclass_fields__:  # the flag comes with migration support
        args += ["--transfer-address", transfer_address]
    return ServiceProcess(instance_id, "instance", args, f"127.0.0.1:{port}", log_dir)


async def _wait_serving(ops: OpsCluster) -> None:
    """Until the leader lists both instances as serving with a load report kept. Serving alone is not enough:
    an instance is listed serving from its etcd record on (in its first grace), and while another one has
    reported, dispatch passes it over (Dispatcher._reported_first), so a burst dispatched then all went to
    the other instance (a first report late under load: test_dispatch_reservations saw 6 on instance-1)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with AdminClient(ops.admin_address, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            reported = {r.instance_id for r in await client.list_instances()
                        if r.state == "serving" and r.report_age_s >= 0}
            if reported == {INSTANCE_ID, OTHER_INSTANCE_ID}:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the instances never became serving, reported, at the manager\n{ops.log_tails()}")


@contextlib.contextmanager
def running_request(instance_address: str, max_tokens: int = 900, request_id: str = "") -> Iterator[str]:
    """A long greedy generation on the instance, read in a thread; cancelled on exit."""
    request_id = request_id or f"ops-{uuid.uuid4().hex[:8]}"
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
