"""A whole local cluster owned by the test process, so fault tests (and benchmarks/chaos.py)
can SIGKILL any child and start it again with the very same arguments, and stop etcd and
bring it back on the same endpoint and data.

The processes are the ones `python -m services.cluster up` starts (services/cluster/
launcher.py: etcd, managers, a transfer service, instances, a frontend), with short etcd
lease TTLs so lease loss and failover happen within seconds. Also here: a streaming
OpenAI client that records every token id and any error event, a reference engine for
the token ids a request must get, and the admin reads that check block accounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import grpc
import llguidance
import pytest
import torch

from services.cluster.launcher import ClusterSpec, LocalCluster
from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams
from services.instance.engine.tokenizer import Tokenizer

_HEALTH_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class FaultTimings:
    """etcd lease TTLs of the children (short, so faults play out within a test)."""

    instance_lease_ttl_s: float = 2.0
    manager_lease_ttl_s: float = 3.0
    transfer_lease_ttl_s: float = 2.0

    def env(self) -> dict[str, str]:
        return {"FERRY_INSTANCE_LEASE_TTL_S": str(self.instance_lease_ttl_s),
                "FERRY_MANAGER_LEASE_TTL_S": str(self.manager_lease_ttl_s),
                "FERRY_TRANSFER_LEASE_TTL_S": str(self.transfer_lease_ttl_s)}


class FaultCluster:
    """`with FaultCluster(...).running() as cluster:` — every child is killed or stopped at the end."""

    def __init__(self, model_dir: pathlib.Path, state_dir: pathlib.Path, *, num_instances: int = 2,
                 num_managers: int = 2, kv_cache_mib: int = 16, timings: FaultTimings = FaultTimings(),
                 transfer_backend: str = "grpc", roles: tuple[str, ...] = ()) -> None:
        """`roles` (e.g. ("prefill", "decode", "decode")) instead of `num_instances` instances of role both."""
        self.model_dir = model_dir
        self.timings = timings
        spec = ClusterSpec(model_dir=model_dir, roles=roles or ("both",) * num_instances, num_managers=num_managers,
                           engine="torch", transfer_backend=transfer_backend, http_port=free_port(),
                           admin_port=free_port(),
                           state_dir=state_dir, cluster="ferry", threads_per_instance=1, kv_cache_mib=kv_cache_mib,
                           log_format="console")
        self._cluster = LocalCluster(spec)
        self.extra: list[ServiceProcess] = []  # started by tests (more frontends)

    @contextlib.contextmanager
    def running(self) -> Iterator[FaultCluster]:
        try:
            with _environ(self.timings.env()):
                asyncio.run(self._cluster.start())
            for process in self._cluster.processes:
                process.env.update(self.timings.env())  # a restart gets the same settings
            yield self
        finally:
            for process in self.extra:
                process.stop()
            self._cluster.stop()

    # -- what is running -----------------------------------------------------------------

    @property
    def etcd(self) -> LocalEtcd:
        return self._cluster.etcd

    @property
    def frontend_url(self) -> str:
        return self._cluster.frontend_url

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    @property
    def state_dir(self) -> pathlib.Path:
        return self._cluster.state_dir

    def process(self, name: str) -> ServiceProcess:
        return next(p for p in [*self._cluster.processes, *self.extra] if p.name == name)

    def names(self, kind: str) -> list[str]:
        return [p.name for p in self._cluster.processes if p.module == kind]

    def pids(self) -> dict[str, int | None]:
        return {p.name: p.pid for p in [*self._cluster.processes, *self.extra]}

    def dead(self) -> list[str]:
        return [p.name for p in [*self._cluster.processes, *self.extra] if not p.is_alive()]

    # -- faults --------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL the child (by its PID)."""
        self.process(name).kill()

    async def restart(self, name: str) -> None:
        """Start a killed child again with the same arguments and wait until it is healthy."""
        process = self.process(name)
        if process.is_alive():
            raise RuntimeError(f"{name} is still running (pid {process.pid}); kill it first")
        process.start()
        await process.wait_healthy(_HEALTH_TIMEOUT_S)

    def freeze(self, name: str) -> None:
        """SIGSTOP the child, or etcd (`name` "etcd"): its sockets stay open, nothing answers."""
        if name == "etcd":
            self.etcd.pause()
        else:
            self.process(name).signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT what `freeze` stopped."""
        if name == "etcd":
            self.etcd.resume()
        else:
            self.process(name).signal(signal.SIGCONT)

    def lease_ttl_s(self, name: str) -> float:
        """The etcd lease TTL of the child (for etcd: the shortest, the first a freeze of it outlasts)."""
        module = "etcd" if name == "etcd" else self.process(name).module
        ttls = {"instance": self.timings.instance_lease_ttl_s, "manager": self.timings.manager_lease_ttl_s,
                "transfer": self.timings.transfer_lease_ttl_s}
        if module == "frontend":
            return 5.0  # the frontend's registry keeps the default TTL (services/common/registry.py)
        return ttls.get(module, min(ttls.values()))

    def kill_etcd(self) -> None:
        """SIGKILL etcd (a crash: no clean shutdown); `restart_etcd` brings it back on the same data dir."""
        os.kill(self.etcd.pid, signal.SIGKILL)
        self.etcd.terminate()  # reaps it and closes its log

    async def restart_etcd(self) -> None:
        await self.etcd.start_async()

    async def start_frontend(self, name: str, *args: str) -> ServiceProcess:
        """One more frontend on the same etcd, with extra flags (e.g. --max-resumes 0)."""
        url = f"http://127.0.0.1:{free_port()}"
        flags = ["--model", str(self.model_dir), "--port", url.rsplit(":", 1)[1], "--frontend-id", name,
                 "--etcd-endpoints", self.etcd.endpoint, "--cluster", "ferry", *args]
        process = ServiceProcess(name, "frontend", flags, url, self.state_dir / "logs", env=self.timings.env())
        self.extra.append(process.start())
        await process.wait_healthy(_HEALTH_TIMEOUT_S)
        return process

    # -- admin reads ---------------------------------------------------------------------

    async def leader(self, timeout_s: float = 30.0) -> str:
        """Name of the live manager that leads (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name in self.names("manager"):
                process = self.process(name)
                if process.is_alive() and (await self.cluster_status(process.address)).leader_id == name:
                    return name
            if time.monotonic() > deadline:
                raise TimeoutError(f"no manager leads after {timeout_s} s")
            await asyncio.sleep(0.2)

    async def cluster_status(self, address: str) -> manager_pb2.GetClusterStatusResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                return await manager_pb2_grpc.AdminServiceStub(channel).GetClusterStatus(
                    manager_pb2.GetClusterStatusRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return manager_pb2.GetClusterStatusResponse()

    async def admin(self, method: str, request, timeout_s: float = 10.0):
        """Call AdminService/<method> on the leader."""
        address = self.process(await self.leader()).address
        async with grpc.aio.insecure_channel(address) as channel:
            return await getattr(manager_pb2_grpc.AdminServiceStub(channel), method)(request, timeout=timeout_s)

    async def instances(self) -> dict[str, manager_pb2.InstanceInfo]:
        reply = await self.admin("ListInstances", manager_pb2.ListInstancesRequest())
        return {i.instance_id: i for i in reply.instances}

    async def set_policy(self, **fields) -> None:
        await self.admin("SetPolicy", manager_pb2.Policy(**fields))

    async def free_blocks(self, instance_ids: Sequence[str] | None = None, timeout_s: float = 30.0,
                          is_idle: bool = True) -> dict[str, int]:
        """Free blocks of the instances, once each of them reports fresh load (and, with `is_idle`,
        runs no request: a baseline must not count blocks an earlier test is still releasing)."""
        ids = list(instance_ids or self.names("instance"))
        deadline = time.monotonic() + timeout_s
        while True:
            infos = await self.instances()
            if all(i in infos and 0 <= infos[i].report_age_s < 1.0 and (not is_idle or _is_idle(infos[i]))
                   for i in ids):
                return {i: infos[i].num_free_blocks for i in ids}
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ids} not all reporting and idle after {timeout_s} s: {sorted(infos)}")
            await asyncio.sleep(0.2)

    async def wait_blocks_back(self, baseline: dict[str, int], timeout_s: float = 30.0) -> None:
        """Every instance of `baseline` again has exactly its free blocks (no request holds any)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = await self.free_blocks(list(baseline), timeout_s)
            if now == baseline:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"free blocks {now}, expected {baseline} (blocks leaked)")
            await asyncio.sleep(0.2)

    async def metric(self, url: str, name: str) -> float:
        """One sample of a Prometheus metric from `url`/metrics (first match of `name`)."""
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not in {url}/metrics")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- the client side ---------------------------------------------------------------------


@dataclass(slots=True)
class Stream:
    """One streamed completion as the client saw it: every token id, the finish, or the error event."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # a stop string that never matches still holds its length - 1 characters back
    guided_regex: str | None = None  # constrained decoding: the text matches this regex
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # an error event, an HTTP error or a dropped connection
    num_done_markers: int = 0

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.finish_reason is not None and self.num_done_markers == 1

    async def run(self, session: aiohttp.ClientSession, base_url: str, model: str) -> Stream:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                "temperature": self.temperature, "return_token_ids": True, "ignore_eos": True}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.guided_regex is not None:
            body["guided_regex"] = self.guided_regex
        try:
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                self.request_id = response.headers.get("x-request-id", "")
                if response.status != 200:
                    self.error = f"HTTP {response.status}: {await response.text()}"
                    return self
                async for line in response.content:
                    self._take(line.decode().strip())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.error = f"connection: {exc!r}"
        return self

    def _take(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.num_done_markers += 1
            return
        event = json.loads(data)
        if "error" in event:
            self.error = event["error"].get("message", str(event["error"]))
            return
        for choice in event.get("choices", []):
            self.token_ids += choice.get("token_ids") or []
            self.text += choice.get("text") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


async def wait_for_tokens(streams: Sequence[Stream], num_tokens: int, timeout_s: float = 60.0) -> None:
    """Until every stream has at least `num_tokens` tokens (or ended)."""
    deadline = time.monotonic() + timeout_s
    while not all(len(s.token_ids) >= num_tokens or s.finish_reason or s.error for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {num_tokens} tokens in {timeout_s} s")
        await asyncio.sleep(0.02)


def client_session(timeout_s: float = 300.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))


class Reference:
    """What each request must produce: one local engine, never killed, never migrated."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        torch.set_num_threads(1)  # the cluster's processes share the same few cores
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self._loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-fault-ref-{os.getpid()}", num_blocks=4096))
        self._ids = itertools.count()

    def tokens(self, streams: Sequence[Stream]) -> list[list[int]]:
        """Reference token ids of each stream's prompt and sampling, all in one batch."""
        return [token_ids for token_ids, _ in self.outputs(streams)]

    def outputs(self, streams: Sequence[Stream]) -> list[tuple[list[int], str]]:
        """Reference token ids and text of each stream's prompt and sampling, all in one batch."""
        engine = self._loaded.engine
        request_ids = [f"reference-{next(self._ids)}" for _ in streams]
        for request_id, s in zip(request_ids, streams):
            grammar = "" if s.guided_regex is None else llguidance.LLMatcher.grammar_from_regex(s.guided_regex)
            sampling = SamplingParams(temperature=s.temperature, seed=s.seed, max_tokens=s.max_tokens, ignore_eos=True,
                                      stop=tuple(s.stop), grammar=grammar)
            engine.add_request(request_id, self.tokenizer.encode(s.prompt), sampling)
        outputs: dict[str, tuple[list[int], list[str]]] = {request_id: ([], []) for request_id in request_ids}
        num_unfinished = len(request_ids)
        while num_unfinished:
            for output in engine.step():
                token_ids, texts = outputs[output.request_id]
                token_ids += output.new_token_ids
                texts.append(output.text)
                num_unfinished -= output.finish_reason is not None
        return [(outputs[r][0], "".join(outputs[r][1])) for r in request_ids]

    def close(self) -> None:
        self._loaded.close()


def _is_idle(info: manager_pb2.InstanceInfo) -> bool:
    """No request runs or waits there (a request of an earlier test may still be releasing its blocks)."""
    return info.num_running == 0 and info.num_waiting == 0


@pytest.fixture(scope="module", name="reference")
def fault_reference(tiny_model_dir) -> Iterator[Reference]:
    """The fault tests' `reference` (a module that imports this gets it in place of conftest's generate function)."""
    reference = Reference(tiny_model_dir)
    yield reference
    reference.close()
