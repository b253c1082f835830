"""Dispatch latency of a real manager process with many instances reporting load.

    PYTHONPATH=. .venv/bin/python benchmarks/dispatch.py [--instances 64] [--rate 500] [--seconds 5]

Starts a local etcd and one manager on loopback, registers N simulated instances in
etcd, streams their load reports (every --report-interval-s, from a separate process so
the reporters do not share the measuring event loop), then sends Dispatch at a fixed
rate (open loop: one call every 1/rate s, whatever the previous ones are doing) and
prints client-side latency percentiles. Target: p99 <= 2 ms at 64 instances, 500/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etcd3aio import Etcd3Client  # noqa: E402

from services.common.etcd_launcher import LocalEtcd, free_port  # noqa: E402
from services.common.gen.ferry.v1 import common_pb2  # noqa: E402
from services.manager.client import ManagerClient  # noqa: E402
from services.manager.policies import POLICY_NAMES  # noqa: E402
from tests.integration.manager_harness import start_manager  # noqa: E402
from benchmarks.stopping import as_ctrl_c, logs_kept_on_failure  # noqa: E402
from benchmarks.flags import HelpFormatter  # noqa: E402

CLUSTER = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--instances", type=int, default=64, help="registered (fake) instances to choose among")
    parser.add_argument("--rate", type=float, default=500.0, help="dispatches per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured duration")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="dispatching before the measured part")
    parser.add_argument("--report-interval-s", type=float, default=0.075, help="each instance's load report period")
    parser.add_argument("--policy", default="load", choices=POLICY_NAMES, help="the manager's --dispatch-policy")
    args = parser.parse_args()
    positive = {"--instances": args.instances, "--rate": args.rate, "--seconds": args.seconds,
                "--report-interval-s": args.report_interval_s}
    if bad := [f"{flag} {value:g}" for flag, value in positive.items() if value <= 0]:
        parser.error(f"{', '.join(bad)}: must be above 0")
    if args.warmup_s < 0:
        parser.error(f"--warmup-s {args.warmup_s:g}: must be 0 or more")
    if args.rate * args.seconds < 1:
        parser.error(f"--rate {args.rate:g} for --seconds {args.seconds:g} sends no dispatch")
    return args


async def register(etcd_endpoint: str, num_instances: int) -> None:
    client = Etcd3Client([etcd_endpoint])
    await client.connect()
    for n in range(num_instances):
        record = {"address": f"127.0.0.1:{20000 + n}", "role": "both", "model": "sim", "pid": 1, "host": "bench",
                  "state": "serving", "kv": {"block_size": 16, "num_blocks": 4096}}
        await client.kv.put(f"/ferry/{CLUSTER}/instances/i-{n:03d}", json.dumps(record))
    await client.close()


def run_reporters(address: str, num_instances: int, interval_s: float) -> None:
    """Child process: one ReportLoad stream per instance, with drifting random load."""
    async def report(client: ManagerClient, instance_id: str):
        async def reports():
            while True:
                running = random.randint(0, 32)
                yield common_pb2.LoadReport(instance_id=instance_id, num_running=running, num_waiting=random.randint(0, 2),
                                            num_free_blocks=random.randint(500, 4096), num_total_blocks=4096,
                                            timestamp=time.time())
                await asyncio.sleep(interval_s * random.uniform(0.8, 1.2))
        while True:
            with contextlib.suppress(Exception):
                await client.report_load(reports())
            await asyncio.sleep(0.1)

    async def main():
        async with ManagerClient(address) as client:
            await asyncio.gather(*(report(client, f"i-{n:03d}") for n in range(num_instances)))

    asyncio.run(main())


async def measure(address: str, rate: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    errors = 0

    async def one(client: ManagerClient, n: int) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            await client.dispatch(f"bench-{n}", num_prompt_tokens=random.randint(16, 2048), timeout_s=1.0)
        except Exception:  # noqa: BLE001 — counted and reported
            errors += 1
            return
        latencies.append(time.perf_counter() - started)

    async with ManagerClient(address) as client:
        tasks = set()
        period = 1.0 / rate
        start = time.perf_counter()
        for n in range(int(rate * seconds)):
            delay = start + n * period - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(client, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    if errors:
        print(f"errors: {errors}")
    return latencies


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape_histogram(port: int, name: str) -> list[tuple[float, float]]:
    """(upper bound s, cumulative count) of a Prometheus histogram, from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    return buckets


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> str:
    total = buckets[-1][1]
    bound = next(b for b, count in buckets if count >= q * total)
    return "inf" if bound == float("inf") else f"{bound * 1000:g}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ferry-bench-"))  # the manager's log
    with logs_kept_on_failure("dispatch", log_dir, log_dir):
        asyncio.run(run(args, log_dir))


async def run(args: argparse.Namespace, log_dir: pathlib.Path) -> None:
    async with LocalEtcd() as etcd:
        await register(etcd.endpoint, args.instances)
        metrics_port = free_port()
        manager = await start_manager(etcd.endpoint, CLUSTER, "bench-manager", log_dir, "--log-level", "warning",
                                      "--dispatch-policy", args.policy, "--metrics-port", str(metrics_port))
        reporters = multiprocessing.get_context("spawn").Process(
            target=run_reporters, args=(manager.address, args.instances, args.report_interval_s), daemon=True)
        reporters.start()
        try:
            await asyncio.sleep(1.0)  # election + first reports
            await measure(manager.address, args.rate, args.warmup_s)
            cpu_before = cpu_seconds(manager.process.pid)
            latencies = await measure(manager.address, args.rate, args.seconds)
            manager_cpu = (cpu_seconds(manager.process.pid) - cpu_before) / args.seconds
            handler_buckets = scrape_histogram(metrics_port, "ferry_manager_dispatch_latency_seconds")
        finally:
            reporters.terminate()
            reporters.join(5)
            await manager.stop()
    if not latencies:
        raise SystemExit("dispatch: every Dispatch failed (see errors above)")
    ms = [x * 1000 for x in latencies]
    print(f"dispatch: {len(ms)} calls at {args.rate:.0f}/s over {args.seconds:.0f} s, {args.instances} instances "
          f"reporting every {args.report_interval_s * 1000:.0f} ms, policy {args.policy}")
    print(f"latency ms: p50 {statistics.median(ms):.3f}  p90 {percentile(ms, 0.9):.3f}  "
          f"p99 {percentile(ms, 0.99):.3f}  max {max(ms):.3f}  (target p99 <= 2 ms)")
    print(f"manager process CPU: {manager_cpu * 100:.0f}% of one core")
    print(f"in the handler (server histogram, warmup included): p50 <= {bucket_quantile(handler_buckets, 0.5)} ms  "
          f"p99 <= {bucket_quantile(handler_buckets, 0.99)} ms")
    print(f"load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(a busy machine shows up in the client-side tail, not in the handler)")


if __name__ == "__main__":
    main()
