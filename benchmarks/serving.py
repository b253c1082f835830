"""Serving latency: Poisson arrivals against the OpenAI API of a ferry cluster.

Prompt and output lengths are drawn from a long-tailed (log-normal) distribution with
a fixed seed, so two runs with the same flags send the same workload. Each request
streams; we record time to first token (prefill) and the gaps between tokens
(decode). Prints exactly these two tables, then throughput and the overhead of the
serving path (client inter-token latency minus the instances' own step time):

    prefill	p25	p50	p75	p95	p99	mean
    latency(ms)	…
    decode	p25	p50	p75	p95	p99	mean
    latency(ms)	…

and writes JSON and a PNG latency CDF to --out-dir.

The overhead line is the client's decode p50 minus the instances' median step weighted by the
tokens each step made (LoadReport.step_time_ms_token_weighted_p50, sampled every 3 s from each instance that stepped
since the last sample; the plain
median step is printed beside it): what the serving path (instance, gRPC, frontend, HTTP) adds
to a typical token while a step is much longer than that path's cost per token (SmolLM2 on
CPU: steps of 30-120 ms). Weighted, because a client's token gaps follow the tokens: a step of a
batch of 8 is 8 gaps of its length, a step of 1 request one, and under load the long steps are
the big batches, so the plain median step sits below the median token's and the figure swung
with the mix of batch sizes (-4 to +6 ms at load average ~10). A tiny model's steps of 1-2 ms
outpace that path: tokens then reach the client in bursts, several events per read, whose gaps
of ~0 ms pull the client p50 below the step p50, and the figure goes negative (marked so). There the path, not the engine, sets the pace: read the decode mean and
the throughput instead. An instance from before the weighted figure reports 0 for it: the line
then falls back to the plain median, and says so.

    python benchmarks/serving.py --model models/smollm2-135m-instruct --instances 2 --rate 2 --num-requests 100
    python benchmarks/serving.py --url http://127.0.0.1:8000 --admin 127.0.0.1:50051   # an existing cluster (--model: the folder it serves)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import aiohttp
import grpc
import numpy as np
from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.flags import HelpFormatter, above_zero, at_least, prefill_decode  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402
from services.common.etcd_launcher import free_port  # noqa: E402
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc  # noqa: E402

PERCENTILES = (25, 50, 75, 95, 99)


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    output_len: int
    ttft_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    """Defaults of the workload flags (`workload()` reads them from the parsed args)."""

    num_requests: int = 64
    rate: float = 2.0
    prompt_mean: int = 128
    output_mean: int = 64
    sigma: float = 0.8
    max_prompt: int = 1024
    max_output: int = 512
    num_prefixes: int = 0
    prefix_len: int = 256


def add_workload_args(parser: argparse.ArgumentParser, defaults: Workload) -> None:
    """The flags of the seeded workload: Poisson (or Gamma, --burstiness) arrivals, log-normal lengths."""
    parser.add_argument("--num-requests", type=at_least(1), default=defaults.num_requests, help="requests to send")
    parser.add_argument("--rate", type=above_zero, default=defaults.rate, help="mean arrival rate (requests/s)")
    parser.add_argument("--burstiness", type=above_zero, default=1.0,
                        help="shape of the Gamma distribution of the gaps between arrivals, as vLLM's benchmark_serving "
                             "--burstiness: 1 is a Poisson process, below 1 burstier (gaps vary by 1/sqrt(burstiness) "
                             "of their mean: 0.25 gives bursts and lulls at the same mean rate), above 1 more even")
    parser.add_argument("--prompt-mean", type=at_least(1), default=defaults.prompt_mean, help="median prompt length in tokens")
    parser.add_argument("--output-mean", type=at_least(1), default=defaults.output_mean, help="median output length in tokens")
    parser.add_argument("--sigma", type=float, default=defaults.sigma,
                        help="log-normal sigma of both lengths (long tail)")
    parser.add_argument("--max-prompt", type=int, default=defaults.max_prompt, help="prompt length cap")
    parser.add_argument("--max-output", type=int, default=defaults.max_output, help="output length cap")
    parser.add_argument("--num-prefixes", type=int, default=defaults.num_prefixes,
                        help="shared prompt prefixes (system prompts, few-shot examples): each prompt starts with "
                             "one of them, drawn uniformly, then its own tokens; 0 = every prompt is its own")
    parser.add_argument("--prefix-len", type=int, default=defaults.prefix_len,
                        help="tokens of each shared prefix (with --num-prefixes)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (the same seed sends the same requests)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--url", help="frontend base URL of a running cluster (default: start one)")
    parser.add_argument("--admin", help="admin address of that cluster (for the instances' step times)")
    parser.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "smollm2-135m-instruct",
                        help="model folder: the cluster this benchmark starts serves it, and prompts are "
                             "drawn from its vocabulary (with --url, the served model's)")
    parser.add_argument("--instances", type=at_least(1), default=2, help="instances of a started cluster (role both)")
    parser.add_argument("--pd", type=prefill_decode, default=None, help="P:D — start P prefill and D decode instances instead of --instances")
    parser.add_argument("--launcher-args", default="", help="extra flags for `services.cluster up` (quoted)")
    add_workload_args(parser, Workload())
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench-results", help="where JSON and PNG go")
    parser.add_argument("--tag", default="serving", help="file name prefix of the outputs")
    return parser.parse_args()


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt token ids, output length) per request, from the seed alone."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab_size - 100) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    arrivals, now = [], 0.0
    for _ in range(args.num_requests):
        now += arrival_gap(rng, args.rate, args.burstiness)
        prompt_len = min(args.max_prompt, max(4, int(rng.lognormvariate(np.log(args.prompt_mean), args.sigma))))
        output_len = min(args.max_output, max(2, int(rng.lognormvariate(np.log(args.output_mean), args.sigma))))
        prefix = rng.choice(prefixes) if prefixes else []
        prompt = prefix + [rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)]
        arrivals.append((now, prompt, output_len))
    return arrivals


def arrival_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """Seconds to the next arrival: Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate, as vLLM's
    benchmark_serving draws them. Burstiness 1 draws exactly what the Poisson workload always drew (same seed,
    same requests)."""
    if burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def send(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int) -> RequestResult:
    result = RequestResult(len(prompt), output_len)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                if line.strip() == b"data: [DONE]":
                    return result
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b'data: {"error"'):  # after the 200 an error event ends the stream
                    result.error = f"error event: {line[6:].strip()[:200].decode(errors='replace')}"
                    return result
                now = time.perf_counter()
                if result.num_tokens == 0:
                    result.ttft_ms = (now - start) * 1000
                else:
                    result.itl_ms.append((now - last) * 1000)
                last = now
                result.num_tokens += 1
            # The frontend ends every stream with [DONE]; one that ends before (a proxy whose upstream died) was cut
            result.error = f"truncated: the stream ended without data: [DONE] after {result.num_tokens} tokens"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_workload(url: str, model: str, requests: list[tuple[float, list[int], int]]) -> tuple[list[RequestResult], float]:
    progress = tqdm(total=len(requests), desc="requests", unit="req")
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def one(offset: float, prompt: list[int], output_len: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            result = await send(session, url, model, prompt, output_len)
            progress.update(1)
            return result

        results = await asyncio.gather(*(one(*request) for request in requests))
        elapsed = time.perf_counter() - start
    progress.close()
    return list(results), elapsed


STEP_SAMPLE_INTERVAL_S = 3.0


@dataclass(frozen=True, slots=True)
class StepSample:
    """One instance's median step over its last 256 steps: plain, and weighted by each step's tokens."""

    plain_ms: float
    token_weighted_ms: float  # 0 from an instance that does not report it


async def instance_step_times(admin: str, num_steps_seen: dict[str, int]) -> list[StepSample]:
    """Each instance's step medians, if it stepped since the last look (`num_steps_seen`: its step count then)."""
    async with grpc.aio.insecure_channel(admin) as channel:
        instances = (await manager_pb2_grpc.AdminServiceStub(channel).ListInstances(
            manager_pb2.ListInstancesRequest(), timeout=5)).instances
    loads = []
    for instance in instances:
        async with grpc.aio.insecure_channel(instance.address) as channel:
            loads.append((await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(
                instance_pb2.GetStatusRequest(), timeout=5)).load)
    return fresh_step_samples(loads, num_steps_seen)


def fresh_step_samples(loads: list, num_steps_seen: dict[str, int]) -> list[StepSample]:
    """The step medians of the load reports whose instance stepped since `num_steps_seen` (updated). An idle
    instance's window still holds its last busy steps: sampled again and again, they outweighed the busy one's."""
    samples = []
    for load in loads:
        if load.num_steps > num_steps_seen.get(load.instance_id, 0):
            samples.append(StepSample(load.step_time_ms_p50, load.step_time_ms_token_weighted_p50))
        num_steps_seen[load.instance_id] = load.num_steps
    return samples


def table(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}\t" + "\t".join(f"p{p}" for p in PERCENTILES) + "\tmean\nlatency(ms)\t(no data)"
    cells = [f"{np.percentile(values, p):.2f}" for p in PERCENTILES] + [f"{np.mean(values):.2f}"]
    header = f"{name}\t" + "\t".join(f"p{p}" for p in PERCENTILES) + "\tmean"
    return f"{header}\nlatency(ms)\t" + "\t".join(cells)


def plot_cdf(ttft: list[float], itl: list[float], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, name in ((axes[0], ttft, "prefill: time to first token"), (axes[1], itl, "decode: inter-token latency")):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def started_cluster(args: argparse.Namespace) -> Iterator[dict]:
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp:
        state_dir = pathlib.Path(tmp) / "state"
        roles = ["--instances", str(args.instances)]
        if args.pd:
            prefill, decode = args.pd.split(":")
            roles = ["--instances", "0", "--prefill-instances", prefill, "--decode-instances", decode]
        command = [sys.executable, "-m", "services.cluster", "up", "--model", str(args.model), "--state-dir", str(state_dir),
                   "--http-port", str(free_port()), "--admin-port", str(free_port()), *roles, *args.launcher_args.split()]
        log = open(pathlib.Path(tmp) / "launcher.log", "wb")
        launcher = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 300
            while not (state_dir / "cluster.json").exists():
                if launcher.poll() is not None or time.monotonic() > deadline:
                    sys.exit("cluster failed to start:\n" + (pathlib.Path(tmp) / "launcher.log").read_text()[-3000:])
                time.sleep(0.1)
            yield json.loads((state_dir / "cluster.json").read_text())
        finally:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(120)
            log.close()


def overhead_line(itl: list[float], step_times: list[StepSample]) -> tuple[str, float, float | None]:
    """The overhead line; the overhead against the token-weighted step (the plain one where no instance reported
    it), and the one against the plain step."""
    client_p50 = float(np.percentile(itl, 50))
    plain_p50 = float(np.median([s.plain_ms for s in step_times]))
    weighted = [s.token_weighted_ms for s in step_times if s.token_weighted_ms > 0]
    step_p50 = float(np.median(weighted)) if weighted else plain_p50
    overhead = client_p50 - step_p50
    step = (f"instance step p50 token-weighted {step_p50:.2f} ms (plain {plain_p50:.2f} ms)" if weighted else
            f"instance step p50 {plain_p50:.2f} ms (plain: the instances report no token-weighted one)")
    line = (f"overhead\tclient decode p50 {client_p50:.2f} ms\t{step}\tadded {overhead:.2f} ms/token"
            + ("\t(negative: tokens came in bursts, see --help)" if overhead < 0 else ""))
    return line, overhead, client_p50 - plain_p50


def report(args: argparse.Namespace, results: list[RequestResult], elapsed: float,
           step_times: list[StepSample]) -> dict:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_ms for r in ok]
    itl = [gap for r in ok for gap in r.itl_ms]
    num_tokens = sum(r.num_tokens for r in ok)
    print(table("prefill", ttft))
    print(table("decode", itl))
    print(f"throughput\t{num_tokens / elapsed:.1f} output tokens/s\t{len(ok) / elapsed:.2f} requests/s\t"
          f"{len(results) - len(ok)} errors\t{elapsed:.1f} s")
    overhead = overhead_plain = None
    if step_times and itl:
        line, overhead, overhead_plain = overhead_line(itl, step_times)
        print(line)
    for r in results:
        if r.error:
            print(f"error: {r.error}", file=sys.stderr)
    return {"args": {k: str(v) for k, v in vars(args).items()}, "elapsed_s": elapsed, "num_errors": len(results) - len(ok),
            "ttft_ms": ttft, "itl_ms": itl, "instance_step_ms_p50": [s.plain_ms for s in step_times],
            "instance_step_ms_token_weighted_p50": [s.token_weighted_ms for s in step_times],
            "overhead_ms_p50": overhead, "overhead_vs_plain_step_ms_p50": overhead_plain,
            "requests": [asdict(r) | {"itl_ms": None} for r in results]}


async def bench(args: argparse.Namespace, url: str, admin: str | None, model_dir: pathlib.Path) -> dict:
    from services.instance.engine.model_config import ModelConfig

    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    requests = workload(args, vocab_size)
    model = await served_model(url, model_dir, vocab_size)
    step_times: list[StepSample] = []
    sampler = asyncio.create_task(sample_step_times(admin, step_times)) if admin else None
    results, elapsed = await run_workload(url, model, requests)
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return report(args, results, elapsed, step_times)


async def served_model(url: str, model_dir: pathlib.Path, vocab_size: int) -> str:
    """The name the cluster at `url` serves (its `--served-model-name`, or its model folder's name),
    after checking that it takes the prompts' token ids, drawn from `model_dir`'s vocabulary: a
    cluster serving another model would refuse every request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{url}/v1/models") as response:
            response.raise_for_status()
            served = (await response.json())["data"][0]["id"]
        async with session.post(f"{url}/detokenize", json={"tokens": [vocab_size - 101]}) as response:
            if response.status == 400:
                error = (await response.json())["error"]["message"]
                sys.exit(f"the cluster at {url} serves {served!r}, whose vocabulary is not that of --model "
                         f"{model_dir} ({error}): pass --model with the folder of the model it serves")
            response.raise_for_status()
    return served


async def sample_step_times(admin: str, samples: list[StepSample], interval_s: float = STEP_SAMPLE_INTERVAL_S) -> None:
    """Every `interval_s` while the workload runs, each instance's median steps over its last
    256 steps: the steps that made the tokens the client is timing (read once at the end, the
    window would hold the short steps of the run's tail)."""
    num_steps_seen: dict[str, int] = {}
    while True:
        await asyncio.sleep(interval_s)
        samples += await instance_step_times(admin, num_steps_seen)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.url:
        summary = asyncio.run(bench(args, args.url, args.admin, args.model))
    else:
        with started_cluster(args) as cluster:
            summary = asyncio.run(bench(args, cluster["frontend_url"], cluster["admin_address"], args.model))
    json_path = args.out_dir / f"{args.tag}.json"
    json_path.write_text(json.dumps(summary))
    plot_cdf(summary["ttft_ms"], summary["itl_ms"], args.out_dir / f"{args.tag}.png",
             f"{args.tag}: {args.num_requests} requests at {args.rate}/s")
    print(f"wrote {json_path} and {args.out_dir / (args.tag + '.png')}")
    if summary["num_errors"]:
        sys.exit(f"{summary['num_errors']} of {args.num_requests} requests failed (listed above): the figures "
                 "leave them out")


if __name__ == "__main__":
    main()
