"""Real manager processes and simulated instances for the manager's integration tests.

A simulated instance is what the manager sees of an instance: its etcd record under
/ferry/<cluster>/instances/<id>, a ReportLoad stream to whichever manager leads, and
(optionally) an InstanceService answering ListRequests. The engine side is not needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from etcd3aio import Etcd3Client

from services.common.errors import FerryError
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.grpc_server import GrpcServer, start_grpc_server
from services.manager.client import ManagerClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0


@dataclass
class ManagerProcess:
    manager_id: str
    address: str
    process: asyncio.subprocess.Process
    log_path: pathlib.Path

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def kill(self) -> None:
        """SIGKILL: no resign, the leader key goes only when its lease expires."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
        return await self.process.wait()


def _profiler_args(manager_id: str) -> list[str]:
    # FERRY_PROFILE_DIR=dir: run the manager under cProfile (for benchmarks/dispatch.py investigations)
    profile_dir = os.environ.get("FERRY_PROFILE_DIR")
    return ["-m", "cProfile", "-o", f"{profile_dir}/manager-{manager_id}.prof"] if profile_dir else []


async def start_manager(etcd_endpoint: str, cluster: str, manager_id: str, log_dir: pathlib.Path,
                        *extra_args: str) -> ManagerProcess:
    log_path = log_dir / f"manager-{manager_id}.log"
    with open(log_path, "ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *_profiler_args(manager_id), "-m", "services.manager", "--port", "0", "--etcd-endpoints", etcd_endpoint,
            "--cluster", cluster, "--manager-id", manager_id, *extra_args,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=log_file)
    try:
        line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        raise
    words = line.decode().split()
    if len(words) != 3 or words[0] != "ready":
        await process.wait()
        raise RuntimeError(f"manager {manager_id} did not start: {line!r}\n{log_path.read_text()[-3000:]}")
    return ManagerProcess(manager_id, words[2], process, log_path)


async def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` (sync or async) until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(interval_s)


async def leader_of(manager: ManagerProcess) -> str:
    async with ManagerClient(manager.address) as client:
        with contextlib.suppress(FerryError):
            status = await client.get_cluster_status()
            return status.leader_id
    return ""


class FakeInstanceService(instance_pb2_grpc.InstanceServiceServicer):
    def __init__(self, instance_id: str, request_ids: Sequence[str]) -> None:
        self._instance_id = instance_id
        self._request_ids = request_ids

    async def ListRequests(self, request, context):
        return instance_pb2.ListRequestsResponse(requests=[
            instance_pb2.RequestInfo(request_id=r, instance_id=self._instance_id, num_tokens=10, state="running")
            for r in self._request_ids])


@dataclass
class SimulatedInstance:
    instance_id: str
    address: str
    num_free_blocks: int = 1000
    num_running: int = 0
    num_waiting: int = 0
    report_interval_s: float = 0.05
    is_reporting: bool = True  # False: the stream stays open but says nothing
    max_model_len: int = 0  # in the record when set: the longest sequence it serves
    num_free_migration_out_slots: int | None = None  # reported when set (None: as an older instance, not known)
    num_preemptions: int = 0  # running requests it sent back to its queue since it started (KV pressure)
    num_streams_opened: int = 0
    server: GrpcServer | None = None
    _task: asyncio.Task | None = field(default=None, repr=False)

    def record(self) -> dict:
        return {"instance_id": self.instance_id, "address": self.address, "role": "both", "model": "sim",
                "state": "serving", "pid": 4242, "host": "sim-host",
                "kv": {"block_size": 16, "num_blocks": 1000, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                       "dtype": "float32"}} | ({"max_model_len": self.max_model_len} if self.max_model_len else {})

    async def register(self, etcd: Etcd3Client, cluster: str) -> None:
        await etcd.kv.put(f"/ferry/{cluster}/instances/{self.instance_id}", json.dumps(self.record()))

    def start_reporting(self, manager_addresses: Callable[[], Sequence[str]]) -> None:
        self._task = asyncio.create_task(self._report_loop(manager_addresses))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.server is not None:
            await self.server.stop(0)

    async def _report_loop(self, manager_addresses: Callable[[], Sequence[str]]) -> None:
        # Like an instance: keep a stream open to the leader; on refusal try the next manager.
        while True:
            for address in manager_addresses():
                async with ManagerClient(address) as client:
                    with contextlib.suppress(FerryError):
                        self.num_streams_opened += 1
                        await client.report_load(self._reports())
                await asyncio.sleep(0.05)

    async def _reports(self) -> AsyncIterator[common_pb2.LoadReport]:
        while True:
            if self.is_reporting:
                yield common_pb2.LoadReport(
                    instance_id=self.instance_id, num_running=self.num_running, num_waiting=self.num_waiting,
                    num_free_blocks=self.num_free_blocks, num_total_blocks=1000,
                    num_free_migration_out_slots=self.num_free_migration_out_slots,
                    num_preemptions=self.num_preemptions)
            await asyncio.sleep(self.report_interval_s)


async def serving_instance(instance_id: str, request_ids: Sequence[str]) -> SimulatedInstance:
    """A simulated instance with a real InstanceService (ListRequests) on a free port."""
    servicer = FakeInstanceService(instance_id, request_ids)
    server = await start_grpc_server("127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                       servicer)], ["ferry.v1.InstanceService"])
    return SimulatedInstance(instance_id, server.address, server=server)
