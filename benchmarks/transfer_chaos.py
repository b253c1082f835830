"""Transfer chaos: two transfer services move KV blocks both ways on one channel backend while one
or the other is SIGKILLed (started again on its port or on a new one) or frozen (SIGSTOP, then
SIGCONT) at seeded points. benchmarks/chaos.py runs one transfer service for the whole cluster,
so a gloo channel there never outlives its peer; here every fault breaks channels that a live
service still holds.

Design: worker loops send random transfers (half contiguous, which gloo moves in place, half
scattered, staged) with random deadlines → the fault loop kills or freezes one service, waits,
brings it back (mapping its KV again), then stops the workers, waits for the transfers under way
and checks one transfer each way bit for bit (retried until the services have recovered) → at the
end, each service's log is searched for what must never be there.

Prints the outcome counts, the recovery times, the commonest errors and, per service, how often
its log holds each pattern; exits 1 on a check mismatch, an unexpected exception or any pattern.

    python benchmarks/transfer_chaos.py --duration 180 --seed 3 --min-timeout-s 1 --max-freeze-s 8
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.flags import HelpFormatter, above_zero, at_least  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402
from services.cluster.processes import ServiceProcess, stop_all  # noqa: E402
from services.common.errors import FerryError  # noqa: E402
from services.common.etcd_launcher import LocalEtcd, free_port  # noqa: E402
from services.instance.engine.kv_cache import KvCache, KvGeometry  # noqa: E402
from services.transfer.client import TransferClient  # noqa: E402
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend  # noqa: E402

GEOMETRY = KvGeometry(num_layers=8, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=1024, dtype=torch.float16)
HALF = GEOMETRY.num_blocks // 2  # sources read the first half of a cache, destinations write the second
LOG_PATTERNS = ("Traceback", "never retrieved", "Task was destroyed", "close_failed", "[error", "[critical")
FAULTS = ("kill_same_port", "kill_new_port", "freeze")


class Side:
    """One transfer service (restarted under the same id) and the KV cache it maps."""

    def __init__(self, name: str, etcd: LocalEtcd, cluster: str, log_dir: pathlib.Path, cache: KvCache) -> None:
        self.name, self._etcd, self._cluster, self._log_dir, self.cache = name, etcd, cluster, log_dir, cache
        self.process: ServiceProcess | None = None

    @property
    def address(self) -> str:
        return self.process.address

    def start(self, is_new_port: bool) -> None:
        port = free_port() if is_new_port or self.process is None else int(self.address.rsplit(":", 1)[1])
        args = ["--port", str(port), "--transfer-id", self.name, "--etcd-endpoints", self._etcd.endpoint,
                "--cluster", self._cluster, "--staging-kib", "1024", "--in-place-min-kib", "64",
                "--num-threads", "1", "--lease-ttl-s", "2", "--channel-timeout-s", "5"]
        self.process = ServiceProcess(self.name, "transfer", args, f"127.0.0.1:{port}", self._log_dir).start()

    async def ready(self) -> None:
        await self.process.wait_healthy(60)
        async with TransferClient(self.address) as client:
            await client.map_instance(self.name.lower(), self.cache.name, GEOMETRY)


class TransferChaos:
    def __init__(self, args: argparse.Namespace, sides: dict[str, Side]) -> None:
        self._args, self._sides = args, sides
        self._backend = TransferBackend(args.backend)
        self._rng = random.Random(args.seed)
        self.outcomes: Counter = Counter()
        self.errors: Counter = Counter()  # error messages, addresses and numbers blanked
        self.recoveries_s: list[float] = []
        self._is_running = asyncio.Event()  # cleared while a check runs alone
        self._is_running.set()
        self._num_busy = 0
        self._idle = asyncio.Condition()

    async def run(self) -> None:
        until = time.monotonic() + self._args.duration
        workers = [asyncio.create_task(self._worker_loop(i, until)) for i in range(self._args.workers)]
        await self._fault_loop(until)
        await asyncio.gather(*workers)
        await self._check_alone()

    async def _worker_loop(self, index: int, until: float) -> None:
        rng = random.Random(self._args.seed * 1000 + index)
        while time.monotonic() < until:
            await self._is_running.wait()
            src, dst, src_ids, dst_ids = _random_move(rng)
            self._num_busy += 1
            try:
                await self._transfer(src, dst, src_ids, dst_ids, rng.uniform(self._args.min_timeout_s, 10))
                self.outcomes["ok"] += 1
            except (FerryError, grpc.aio.AioRpcError) as exc:
                self._count_error(type(exc).__name__, exc)
            except Exception as exc:  # noqa: BLE001 - counted as a failure of the run
                self._count_error(f"unexpected_{type(exc).__name__}", exc)
            finally:
                self._num_busy -= 1
                async with self._idle:
                    self._idle.notify_all()
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def _fault_loop(self, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(self._rng.uniform(2, 6))
            kind, victim = self._rng.choice(FAULTS), self._sides[self._rng.choice(sorted(self._sides))]
            self.outcomes[f"fault_{kind}"] += 1
            if kind == "freeze":
                victim.process.signal(signal.SIGSTOP)
                await asyncio.sleep(self._rng.uniform(0.5, self._args.max_freeze_s))
                victim.process.signal(signal.SIGCONT)
            else:
                victim.process.kill()
                await asyncio.sleep(self._rng.uniform(0.2, 1.5))
                victim.start(is_new_port=kind == "kill_new_port")
                await victim.ready()
            await self._check_alone()

    async def _check_alone(self) -> None:
        """No new transfers, wait for those under way, then one each way, bit-exact, retried for up to 60 s."""
        self._is_running.clear()
        async with self._idle:
            await asyncio.wait_for(self._idle.wait_for(lambda: self._num_busy == 0), 60)
        started = time.monotonic()
        for src, dst in (("A", "B"), ("B", "A")):
            while not await self._check_once(src, dst):
                if time.monotonic() - started > 60:
                    raise TimeoutError(f"no transfer {src} -> {dst} worked for 60 s after a fault")
                await asyncio.sleep(0.5)
        self.recoveries_s.append(time.monotonic() - started)
        self._is_running.set()

    async def _check_once(self, src: str, dst: str) -> bool:
        source, destination = self._sides[src].cache.tensor, self._sides[dst].cache.tensor
        src_ids, dst_ids = self._rng.sample(range(HALF), 64), self._rng.sample(range(HALF, GEOMETRY.num_blocks), 64)
        source.copy_(torch.randn(GEOMETRY.shape).to(GEOMETRY.dtype))
        destination.copy_(torch.randn(GEOMETRY.shape).to(GEOMETRY.dtype))
        expected = destination.clone()
        expected[:, :, dst_ids] = source[:, :, src_ids]
        try:
            await self._transfer(src, dst, src_ids, dst_ids, 15)
        except (FerryError, grpc.aio.AioRpcError) as exc:
            self._count_error("check_retry", exc)
            return False
        self.outcomes["check_ok" if torch.equal(destination.view(torch.uint8), expected.view(torch.uint8))
                      else "check_mismatch"] += 1
        return True

    async def _transfer(self, src: str, dst: str, src_ids: list[int], dst_ids: list[int], timeout_s: float) -> None:
        transfer = BlockTransfer(InstanceId(src.lower()), tuple(src_ids), InstanceId(dst.lower()), tuple(dst_ids),
                                 self._sides[dst].address, self._backend, False)
        async with TransferClient(self._sides[src].address) as client:
            await client.transfer(transfer, timeout_s=timeout_s)

    def _count_error(self, outcome: str, exc: BaseException) -> None:
        self.outcomes[outcome] += 1
        message = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        self.errors[re.sub(r"\d+(\.\d+)?", "N", re.sub(r"127\.0\.0\.1:\d+", "ADDR", message or ""))[:200]] += 1


def _random_move(rng: random.Random) -> tuple[str, str, list[int], list[int]]:
    src, dst = rng.choice([("A", "B"), ("B", "A")])
    n = rng.randint(16, HALF)
    if rng.random() < 0.5:  # contiguous on both sides: in place on gloo
        start = rng.randint(0, HALF - n)
        return src, dst, list(range(start, start + n)), list(range(HALF + start, HALF + start + n))
    return src, dst, rng.sample(range(HALF), n), rng.sample(range(HALF, GEOMETRY.num_blocks), n)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=above_zero, default=180.0, help="seconds the workers keep sending transfers")
    parser.add_argument("--seed", type=int, default=0, help="seeds the transfers and the faults")
    parser.add_argument("--backend", default="gloo", choices=["grpc", "gloo"], help="the transfers' backend")
    parser.add_argument("--workers", type=at_least(1), default=6, help="transfers under way at once")
    parser.add_argument("--min-timeout-s", type=above_zero, default=1.0,
                        help="each transfer's deadline is drawn between this and 10 s")
    parser.add_argument("--max-freeze-s", type=above_zero, default=8.0,
                        help="longest freeze (above the services' --channel-timeout-s 5: opens then time out)")
    parser.add_argument("--log-dir", type=pathlib.Path, default=None,
                        help="keep the services' logs here (default: a temporary folder)")
    return parser.parse_args()


async def _run(args: argparse.Namespace, sides: dict[str, Side]) -> TransferChaos:
    for side in sides.values():
        side.start(is_new_port=True)
    await asyncio.gather(*(side.ready() for side in sides.values()))
    chaos = TransferChaos(args, sides)
    await chaos.run()
    return chaos


def _report(chaos: TransferChaos, sides: dict[str, Side]) -> bool:
    print("outcomes", dict(sorted(chaos.outcomes.items())))
    print("recovery_s", " ".join(f"{r:.2f}" for r in chaos.recoveries_s))
    for message, n in chaos.errors.most_common(12):
        print(f"{n:7d} {message}")
    is_clean = not chaos.outcomes["check_mismatch"] and not any(k.startswith("unexpected") for k in chaos.outcomes)
    for name, side in sorted(sides.items()):
        text = side.process.log_path.read_text(errors="replace")
        found = {pattern: text.count(pattern) for pattern in LOG_PATTERNS}
        print(f"log {name}", " ".join(f"{pattern!r}={n}" for pattern, n in found.items()))
        is_clean = is_clean and not any(found.values())
    return is_clean


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    torch.set_num_threads(1)
    caches = {name: KvCache.create(f"ferry-chaos-{name.lower()}-{uuid.uuid4().hex[:6]}", GEOMETRY) for name in "AB"}
    try:
        with tempfile.TemporaryDirectory(prefix="ferry-transfer-chaos-") as tmp, LocalEtcd() as etcd:
            log_dir = args.log_dir or pathlib.Path(tmp)
            cluster = f"transfer-chaos-{uuid.uuid4().hex[:6]}"
            sides = {name: Side(name, etcd, cluster, log_dir, caches[name]) for name in "AB"}
            try:
                chaos = asyncio.run(_run(args, sides))
            finally:
                stop_all([side.process for side in sides.values() if side.process is not None])
            is_clean = _report(chaos, sides)
    finally:
        for cache in caches.values():
            cache.close()
            cache.unlink()
    sys.exit(0 if is_clean else 1)


if __name__ == "__main__":
    main()
