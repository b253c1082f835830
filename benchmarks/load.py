"""Load test: N concurrent streaming clients for D seconds against a ferry cluster.

Each client sends streaming completions back to back (greedy, `ignore_eos`, a fixed
number of output tokens) until the duration is over. Prints the latency tables (time to
first token, inter-token latency, whole request), throughput, the number of errors (an
HTTP error, an error event, a dropped connection, a stream without its finish) and the
frontend's peak RSS (VmHWM from /proc/<pid>/status; the pid comes from cluster.json).
Exits 1 if any request failed.

    python benchmarks/load.py                          # 200 clients, 60 s, tiny model, 2 instances
    python benchmarks/load.py --clients 50 --duration 10
    python benchmarks/load.py --state-dir DIR          # an existing `services.cluster up --state-dir DIR`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp
import signal
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.flags import HelpFormatter, above_zero, at_least  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class LoadResult:
    num_clients: int
    duration_s: float
    elapsed_s: float = 0.0
    num_requests: int = 0
    num_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    request_ms: list[float] = field(default_factory=list)
    frontend_peak_rss_mib: float | None = None

    def tables(self) -> str:
        lines = ["latency(ms)\t" + "\t".join(f"p{p}" for p in PERCENTILES) + "\tmean\tmax"]
        for name, values in (("ttft", self.ttft_ms), ("inter_token", self.itl_ms), ("request", self.request_ms)):
            cells = ([f"{np.percentile(values, p):.1f}" for p in PERCENTILES] + [f"{np.mean(values):.1f}",
                     f"{np.max(values):.1f}"]) if values else ["-"] * (len(PERCENTILES) + 2)
            lines.append(f"{name}\t" + "\t".join(cells))
        rss = f"{self.frontend_peak_rss_mib:.1f}" if self.frontend_peak_rss_mib is not None else "?"
        lines.append(f"throughput\t{self.num_tokens / self.elapsed_s:.1f} output tokens/s\t"
                     f"{self.num_requests / self.elapsed_s:.2f} requests/s\t{self.num_requests} requests\t"
                     f"{len(self.errors)} errors\t{self.num_clients} clients\t{self.elapsed_s:.1f} s")
        lines.append(f"frontend_peak_rss_mib={rss}")
        return "\n".join(lines)


async def run_load(url: str, model: str, num_clients: int, duration_s: float, max_tokens: int) -> LoadResult:
    result = LoadResult(num_clients, duration_s)
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=duration_s + 300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(_client(session, url, model, n, started + duration_s, max_tokens, result)
                               for n in range(num_clients)))
    result.elapsed_s = time.monotonic() - started
    return result


async def _client(session: aiohttp.ClientSession, url: str, model: str, client: int, until: float,
                  max_tokens: int, result: LoadResult) -> None:
    num = 0
    while time.monotonic() < until:
        await _one(session, url, model, f"load client {client} request {num} begins", max_tokens, result)
        num += 1


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
               result: LoadResult) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    sent = last = time.monotonic()
    num_tokens, finish = 0, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.errors.append(f"HTTP {response.status}: {(await response.text())[:200]}")
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.errors.append(f"error event: {event['error']}")
                    return
                for choice in event.get("choices", []):
                    new = len(choice.get("token_ids") or [])
                    if new:
                        now = time.monotonic()
                        (result.ttft_ms if num_tokens == 0 else result.itl_ms).append((now - last) * 1000 / (
                            1 if num_tokens == 0 else new))
                        num_tokens, last = num_tokens + new, now
                    finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.errors.append(f"connection: {exc!r}")
        return
    if finish is None:
        result.errors.append(f"stream ended without a finish after {num_tokens} tokens")
        return
    result.num_requests += 1
    result.num_tokens += num_tokens
    result.request_ms.append((time.monotonic() - sent) * 1000)


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MiB."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def frontend_pid(cluster: dict) -> int:
    return next(p["pid"] for p in cluster["processes"] if p["name"].startswith("frontend"))


async def measure(cluster: dict, num_clients: int, duration_s: float, max_tokens: int) -> LoadResult:
    model = pathlib.Path(cluster["model"]).name
    result = await run_load(cluster["frontend_url"], model, num_clients, duration_s, max_tokens)
    result.frontend_peak_rss_mib = peak_rss_mib(frontend_pid(cluster))
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--clients", type=at_least(1), default=200, help="concurrent streaming clients")
    parser.add_argument("--duration", type=above_zero, default=60.0, help="seconds the clients keep sending")
    parser.add_argument("--max-tokens", type=at_least(1), default=32, help="output tokens per request")
    parser.add_argument("--instances", type=at_least(1), default=2, help="instances of the cluster this starts")
    parser.add_argument("--model", type=pathlib.Path, default=None, help="model folder (default: a tiny random model)")
    parser.add_argument("--state-dir", type=pathlib.Path, default=None,
                        help="use the running cluster whose cluster.json is here instead of starting one")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    if args.state_dir:
        result = asyncio.run(measure(json.loads((args.state_dir / "cluster.json").read_text()), args.clients,
                                     args.duration, args.max_tokens))
    else:
        from services.instance.models.tiny import build_tiny_model
        from tests.e2e.conftest import launched_cluster

        with tempfile.TemporaryDirectory(prefix="ferry-load-") as tmp:
            model = args.model or build_tiny_model(pathlib.Path(tmp) / "tiny", "gqa-tied", seed=0)
            with launched_cluster(model, pathlib.Path(tmp) / "state", "--instances", str(args.instances),
                                  "--kv-cache-mib", "64") as cluster:
                result = asyncio.run(measure(cluster, args.clients, args.duration, args.max_tokens))
    print(result.tables())
    for error in result.errors[:20]:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(1 if result.errors else 0)


if __name__ == "__main__":
    main()
