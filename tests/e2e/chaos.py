"""A seeded chaos run: a streaming workload while faults hit the cluster at random (seeded)
points, with live migration on. Used by tests/e2e/test_chaos.py and benchmarks/chaos.py.

Fault kinds (`ChaosConfig.fault_kinds`; the default is the first three):
* instance, leader, transfer: SIGKILL the busiest instance, the leader manager or the
  transfer service, and start it again after `down_s`;
* freeze: SIGSTOP one process of the cluster (an instance, the transfer service, the leader
  or a standby manager, etcd, the frontend) for `freeze_s`, then SIGCONT; the range spans
  the lease TTLs (2-3 s), so some freezes outlast a lease and some do not;
* etcd: SIGKILL etcd and start it again on its data dir after `etcd_down_s` (every process
  re-registers, a manager is elected again);
* drain: admin Drain of a random instance until it is drained (nothing running or waiting
  there), then Undrain, so it serves again.

Design: the workload loop sends requests (bounded concurrency) → the fault loop throws one
fault, lets the cluster recover (every instance reports to a leader again), waits, repeats →
when the workload is done, compare every request with the reference engine and check block
accounting.

Each request is classified once it ends:
* lost: no complete answer (an error event, an HTTP error, a stream without its finish);
* duplicated: more tokens than the reference (a token delivered twice shifts the rest);
* corrupted: as many tokens as the reference or fewer, but not the same ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc, manager_pb2
from tests.e2e.fault_cluster import FaultCluster, Reference, Stream, client_session

log = structlog.get_logger(__name__)

FAULT_KINDS = ("instance", "leader", "transfer")  # the default: SIGKILL and restart
ALL_FAULT_KINDS = (*FAULT_KINDS, "freeze", "etcd", "drain")
FREEZE_TARGETS = ("instance", "transfer", "leader", "standby", "etcd", "frontend")
DRAIN_TIMEOUT_S = 60.0  # a drained instance's requests migrate off within seconds
RECOVERY_TIMEOUT_S = 60.0  # after a fault, until every instance reports to a leader again


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 0
    num_requests: int = 60  # the workload's size, unless duration_s is set
    duration_s: float = 0.0  # > 0: send requests for this long instead
    concurrency: int = 8  # requests in flight at once
    arrival_gap_s: tuple[float, float] = (0.0, 0.5)  # between two requests (so the run outlasts a round of faults)
    min_tokens: int = 48
    max_tokens: int = 240
    fault_gap_s: tuple[float, float] = (0.5, 2.0)  # between a restart and the next kill
    down_s: tuple[float, float] = (0.2, 1.5)  # how long a killed process stays dead
    fault_kinds: tuple[str, ...] = FAULT_KINDS  # of ALL_FAULT_KINDS
    freeze_s: tuple[float, float] = (0.5, 8.0)  # how long a frozen process stays stopped
    etcd_down_s: tuple[float, float] = (0.5, 8.0)  # how long a killed etcd stays dead


@dataclass(slots=True)
class ChaosResult:
    num_requests: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    resumes: int = 0
    migrations: int = 0  # hand-offs the frontend followed (committed live migrations of streams)
    faults: Counter = field(default_factory=Counter)  # by kind
    frozen: Counter = field(default_factory=Counter)  # freezes by target (instance, etcd, ...)
    long_freezes: int = 0  # freezes longer than the frozen process's lease TTL (for etcd: the shortest TTL)
    busy_instance_kills: int = 0  # instances killed moments after they reported running requests
    drain_s: list[float] = field(default_factory=list)  # Drain to drained, each drain
    stuck_drains: int = 0  # drains not done within DRAIN_TIMEOUT_S, or done while the instance still runs a request
    busy_drains: int = 0  # instances drained moments after they reported running requests
    drains_with_work: int = 0  # drains whose instance still had requests when marked (they migrated off)
    failures: list[str] = field(default_factory=list)  # one line per bad request or drain
    elapsed_s: float = 0.0

    @property
    def is_ok(self) -> bool:
        return self.lost == self.duplicated == self.corrupted == self.stuck_drains == 0

    def line(self) -> str:
        faults = " ".join(f"{_LABELS[kind]}={n}" for kind, n in sorted(self.faults.items()))
        if self.frozen:
            faults += f" long_freezes={self.long_freezes} (" + " ".join(
                f"frozen_{target}={n}" for target, n in sorted(self.frozen.items())) + ")"
        if self.drain_s:
            faults += (f" busy_drains={self.busy_drains} drains_with_work={self.drains_with_work} drain_s_max={max(self.drain_s):.1f}"
                       f" stuck_drains={self.stuck_drains}")
        return (f"requests={self.num_requests} lost={self.lost} duplicated={self.duplicated} "
                f"corrupted={self.corrupted} resumes={self.resumes} migrations={self.migrations} {faults} "
                f"busy_instance_kills={self.busy_instance_kills} "
                f"elapsed_s={self.elapsed_s:.1f}")


_LABELS = {"instance": "killed_instance", "leader": "killed_leader", "transfer": "killed_transfer",
           "freeze": "frozen", "etcd": "killed_etcd", "drain": "drained"}


class ChaosRun:
    def __init__(self, cluster: FaultCluster, reference: Reference, config: ChaosConfig) -> None:
        self._cluster = cluster
        self._reference = reference
        self._config = config
        self._rng = random.Random(config.seed)
        self._fault_rng = random.Random(config.seed + 1)  # faults independent of the workload's draws
        self._streams: list[Stream] = []
        self.result = ChaosResult()

    async def run(self) -> ChaosResult:
        cluster = self._cluster
        await cluster.set_policy(dispatch="flood", migration_enabled=True, migration_threshold=0.0)
        baseline = await cluster.free_blocks()
        before = await self._frontend_counts()
        started = time.monotonic()
        workload = asyncio.create_task(self._workload_loop())
        faults = asyncio.create_task(self._fault_loop(workload))
        await workload
        await faults
        self.result.elapsed_s = time.monotonic() - started
        after = await self._frontend_counts()
        self.result.resumes, self.result.migrations = (a - b for a, b in zip(after, before))
        self._classify()
        await cluster.set_policy(dispatch="load", migration_enabled=False)
        await cluster.wait_blocks_back(baseline, timeout_s=60)
        return self.result

    async def _workload_loop(self) -> None:
        config = self._config
        slots = asyncio.Semaphore(config.concurrency)
        deadline = time.monotonic() + config.duration_s
        async with client_session() as session:
            tasks = []
            while (time.monotonic() < deadline) if config.duration_s > 0 else len(tasks) < config.num_requests:
                await slots.acquire()
                stream = self._next_stream(len(tasks))
                self._streams.append(stream)
                task = asyncio.create_task(stream.run(session, self._cluster.frontend_url, self._cluster.model_name))
                task.add_done_callback(lambda _: slots.release())
                tasks.append(task)
                await asyncio.sleep(self._rng.uniform(*config.arrival_gap_s))
            await asyncio.gather(*tasks)

    def _next_stream(self, n: int) -> Stream:
        max_tokens = self._rng.randint(self._config.min_tokens, self._config.max_tokens)
        if self._rng.random() < 0.5:
            return Stream(f"chaos request {n} of seed {self._config.seed}", max_tokens)
        return Stream(f"chaos request {n} of seed {self._config.seed}", max_tokens, 0.8, self._rng.randrange(1 << 32))

    async def _fault_loop(self, workload: asyncio.Task) -> None:
        # Kinds come in seeded rounds of each kind once, so even a short run hits every kind.
        rng = self._fault_rng
        all_kinds = self._config.fault_kinds
        kinds: list[str] = []
        while not workload.done():
            await _sleep_unless_done(workload, rng.uniform(*self._config.fault_gap_s))
            if workload.done():
                return
            kinds = kinds or rng.sample(all_kinds, len(all_kinds))
            kind = kinds.pop()
            await self._throw(kind)
            self.result.faults[kind] += 1
            # every instance reports to a leader again
            await self._cluster.free_blocks(is_idle=False, timeout_s=RECOVERY_TIMEOUT_S)

    async def _throw(self, kind: str) -> None:
        if kind == "freeze":
            await self._freeze()
        elif kind == "etcd":
            await self._kill_etcd()
        elif kind == "drain":
            await self._drain()
        else:
            await self._kill(kind)

    async def _kill(self, kind: str) -> None:
        name, is_busy = await self._victim(kind)
        seconds = self._fault_rng.uniform(*self._config.down_s)
        log.info("chaos_killed", name=name, is_busy=is_busy, down_s=round(seconds, 2))
        self._cluster.kill(name)
        self.result.busy_instance_kills += is_busy
        await asyncio.sleep(seconds)
        await self._cluster.restart(name)

    async def _freeze(self) -> None:
        rng = self._fault_rng
        target = rng.choice(FREEZE_TARGETS)
        name = await self._freeze_victim(target)
        seconds = rng.uniform(*self._config.freeze_s)
        log.info("chaos_froze", name=name, freeze_s=round(seconds, 2))
        self._cluster.freeze(name)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._cluster.thaw(name)
        self.result.frozen[target] += 1
        self.result.long_freezes += seconds > self._cluster.lease_ttl_s(name)

    async def _freeze_victim(self, target: str) -> str:
        if target == "leader":
            return await self._cluster.leader()
        if target == "standby":
            leader = await self._cluster.leader()
            return self._fault_rng.choice([name for name in self._cluster.names("manager") if name != leader])
        if target == "etcd":
            return "etcd"
        if target == "instance":
            return (await self._busiest_instance())[0]
        return self._cluster.names(target)[0]

    async def _kill_etcd(self) -> None:
        seconds = self._fault_rng.uniform(*self._config.etcd_down_s)
        log.info("chaos_killed", name="etcd", down_s=round(seconds, 2))
        self._cluster.kill_etcd()
        await asyncio.sleep(seconds)
        await self._cluster.restart_etcd()
        await self._cluster.leader(timeout_s=RECOVERY_TIMEOUT_S)

    async def _drain(self) -> None:
        """Drain the busiest instance until nothing runs or waits there, then take it back."""
        name, is_busy = await self._busiest_instance()
        self.result.busy_drains += is_busy
        started = time.monotonic()
        log.info("chaos_draining", name=name, is_busy=is_busy)
        reply = await self._cluster.admin("Drain", manager_pb2.DrainRequest(instance_id=name))
        self.result.drains_with_work += reply.num_remaining > 0
        while not await self._is_drained(name):
            if time.monotonic() - started > DRAIN_TIMEOUT_S:
                self.result.stuck_drains += 1
                self.result.failures.append(f"drain of {name} not done after {DRAIN_TIMEOUT_S:.0f} s")
                break
            await asyncio.sleep(0.1)
        self.result.drain_s.append(time.monotonic() - started)
        log.info("chaos_drained", name=name, num_remaining=reply.num_remaining, drain_s=round(self.result.drain_s[-1], 2))
        await self._check_empty(name)
        await self._cluster.admin("Undrain", manager_pb2.UndrainRequest(instance_id=name))

    async def _check_empty(self, name: str) -> None:
        """A drained instance, asked itself, runs and queues nothing (the leader's word is a load report)."""
        load = await self._load(name)
        if load is not None and load.num_running + load.num_waiting > 0:
            self.result.stuck_drains += 1
            self.result.failures.append(f"drained {name} still runs {load.num_running}, queues {load.num_waiting}")

    async def _is_drained(self, name: str) -> bool:
        info = (await self._cluster.instances()).get(name)
        return info is not None and info.is_drained

    async def _victim(self, kind: str) -> tuple[str, bool]:
        """The process to kill, and whether it is an instance that just reported running requests."""
        if kind == "leader":
            return await self._cluster.leader(), False
        if kind == "transfer":
            return "transfer-0", False
        return await self._busiest_instance()

    async def _busiest_instance(self) -> tuple[str, bool]:
        """The instance with the most running requests, and whether it has any."""
        # The busiest instance, asked directly (a new leader's view starts without load) and all at
        # once (the fault follows the answers at once: requests last a fraction of a second), waiting
        # briefly for one with running requests so the fault costs work; ties by the seeded draw.
        names = self._cluster.names("instance")
        self._fault_rng.shuffle(names)
        deadline = time.monotonic() + 5.0
        while True:
            running = dict(zip(names, await asyncio.gather(*(self._num_running(name) for name in names))))
            busiest = max(names, key=lambda name: running[name])
            if running[busiest] > 0 or time.monotonic() > deadline:
                return busiest, running[busiest] > 0
            await asyncio.sleep(0.05)

    async def _num_running(self, name: str) -> int:
        load = await self._load(name)
        return -1 if load is None else load.num_running

    async def _load(self, name: str) -> common_pb2.LoadReport | None:
        """The instance's own load, or None if it does not answer."""
        process = self._cluster.process(name)
        if not process.is_alive():
            return None
        async with grpc.aio.insecure_channel(process.address) as channel:
            try:
                status = await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(
                    instance_pb2.GetStatusRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return None
        return status.load

    async def _frontend_counts(self) -> tuple[int, int]:
        url = self._cluster.frontend_url
        resumes = await self._cluster.metric(url, "ferry_frontend_stream_resumes_total")
        handoffs = await self._cluster.metric(url, "ferry_frontend_stream_handoffs_total")
        return int(resumes), int(handoffs)

    def _classify(self) -> None:
        result = self.result
        result.num_requests = len(self._streams)
        for stream, expected in zip(self._streams, self._reference.tokens(self._streams)):
            if not stream.is_ok:
                result.lost += 1
                result.failures.append(f"lost {stream.request_id}: {stream.error}")
            elif len(stream.token_ids) > len(expected):
                result.duplicated += 1
                result.failures.append(f"duplicated {stream.request_id}: {len(stream.token_ids)} > {len(expected)}")
            elif stream.token_ids != expected:
                result.corrupted += 1
                first = next((i for i, (a, b) in enumerate(zip(stream.token_ids, expected)) if a != b),
                             len(stream.token_ids))
                result.failures.append(f"corrupted {stream.request_id}: differs from token {first}")


async def _sleep_unless_done(task: asyncio.Task, seconds: float) -> None:
    await asyncio.wait([task], timeout=seconds)
