"""A seeded chaos run: a streaming workload while instances, the leader manager and the
transfer service are SIGKILLed and started again at random (seeded) points, with live
migration on. Used by tests/e2e/test_chaos.py and benchmarks/chaos.py.

Design: the workload loop sends requests (bounded concurrency) → the fault loop kills
one process, waits, restarts it, waits, repeats → when the workload is done, compare
every request with the reference engine and check block accounting.

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

from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from tests.e2e.fault_cluster import FaultCluster, Reference, Stream, client_session

FAULT_KINDS = ("instance", "leader", "transfer")


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


@dataclass(slots=True)
class ChaosResult:
    num_requests: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    resumes: int = 0
    migrations: int = 0  # hand-offs the frontend followed (committed live migrations of streams)
    faults: Counter = field(default_factory=Counter)
    busy_instance_kills: int = 0  # instances killed moments after they reported running requests
    failures: list[str] = field(default_factory=list)  # one line per bad request
    elapsed_s: float = 0.0

    def line(self) -> str:
        faults = " ".join(f"killed_{kind}={n}" for kind, n in sorted(self.faults.items()))
        return (f"requests={self.num_requests} lost={self.lost} duplicated={self.duplicated} "
                f"corrupted={self.corrupted} resumes={self.resumes} migrations={self.migrations} {faults} "
                f"busy_instance_kills={self.busy_instance_kills} "
                f"elapsed_s={self.elapsed_s:.1f}")


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
        # Kinds come in seeded rounds of each kind once, so even a short run hits all three.
        rng = self._fault_rng
        kinds: list[str] = []
        while not workload.done():
            await _sleep_unless_done(workload, rng.uniform(*self._config.fault_gap_s))
            if workload.done():
                return
            kinds = kinds or rng.sample(FAULT_KINDS, len(FAULT_KINDS))
            kind = kinds.pop()
            name, is_busy = await self._victim(kind)
            self._cluster.kill(name)
            self.result.busy_instance_kills += is_busy
            self.result.faults[kind] += 1
            await asyncio.sleep(rng.uniform(*self._config.down_s))
            await self._cluster.restart(name)
            await self._cluster.free_blocks(is_idle=False)  # every instance reports to the leader again

    async def _victim(self, kind: str) -> tuple[str, bool]:
        """The process to kill, and whether it is an instance that just reported running requests."""
        if kind == "leader":
            return await self._cluster.leader(), False
        if kind == "transfer":
            return "transfer-0", False
        # The busiest instance, asked directly (a new leader's view starts without load) and all at
        # once (the kill follows the answers at once: requests last a fraction of a second), waiting
        # briefly for one with running requests so the kill costs work; ties by the seeded draw.
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
        process = self._cluster.process(name)
        if not process.is_alive():
            return -1
        async with grpc.aio.insecure_channel(process.address) as channel:
            try:
                status = await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(
                    instance_pb2.GetStatusRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return -1
        return status.load.num_running

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
