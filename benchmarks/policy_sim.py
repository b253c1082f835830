"""Dispatch and migration policies compared on one cluster of sim instances, over several seeds.

Starts `services.cluster up --engine sim` (instances with the real scheduler, KV cache and
live migration, and a latency model instead of the forward pass: no weights, little CPU),
then, for each seed (`--seeds`), sends that seed's long-tailed workload once per policy
(`dispatch:migration`, default `round_robin:off,load:off,load:on`). Arrivals are Poisson, or
burstier with `--burstiness` below 1 (Gamma gaps, as vLLM's benchmark_serving). Prints one
row per seed and policy, each with its ratios to the first policy of the same seed (the
reference measured in the same run), then one row per policy of the medians over seeds and
the range of each ratio:

    seed  policy  ttft_p50(ms)  ttft_p99(ms)  decode_p50(ms)  decode_p99(ms)  migrations  preemptions  errors  prefix_hit  p99_ttft_vs_first  p99_decode_vs_first
    0     round_robin:off  ...
    policy  seeds  ttft_p50(ms)  ttft_p99(ms)  decode_p50(ms)  decode_p99(ms)  migrations  preemptions  errors  p99_ttft_vs_first  range  p99_decode_vs_first  range
    round_robin:off  5  ...

`decode` is the gap between a request's tokens at the client; `preemptions` are the running
requests the instances sent back to their queue for KV blocks during the run (recomputed
when readmitted), from their /metrics. Instances get few batch slots (--max-num-seqs), so an
instance that drew long requests queues new ones; that is what load-aware dispatch and
migration are for. Writes policy_sim.json and policy_sim.png (latency CDFs, every seed's
requests together) to --out-dir.

    PYTHONPATH=. .venv/bin/python benchmarks/policy_sim.py --instances 4 --num-requests 120 --rate 6 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import time

import aiohttp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import Workload, add_workload_args, run_workload, started_cluster, workload  # noqa: E402
from services.instance.engine.model_config import ModelConfig  # noqa: E402
from services.manager.client import ManagerClient  # noqa: E402
from services.manager.policies import POLICY_NAMES  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402
from benchmarks.flags import HelpFormatter, int_list  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "smollm2-135m-instruct",
                        help="model folder (only config.json and the tokenizer are read)")
    parser.add_argument("--instances", type=int, default=4, help="sim instances")
    parser.add_argument("--policies", default="round_robin:off,load:off,load:on", type=policy_list,
                        help="comma-separated dispatch:migration pairs, run in this order on the same cluster")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="batch slots per instance")
    parser.add_argument("--sim-step-ms", type=float, default=30.0, help="sim step time (slower than a GPU, so the "
                                                                        "client and frontend keep up on a small machine)")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache of each instance (shared memory)")
    parser.add_argument("--sim-prefill-ms-per-token", type=float, default=0.06,
                        help="sim prefill cost per computed prompt token (prefix cache hits cost nothing)")
    add_workload_args(parser, Workload(num_requests=120, rate=6.0, prompt_mean=64, output_mean=48, sigma=1.1,
                                       max_output=600))  # every policy gets the same requests
    parser.add_argument("--seeds", type=int_list(0), default=None,
                        help="comma-separated workload seeds, each run under every policy (default: --seed alone)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench-results", help="where JSON and PNG go")
    args = parser.parse_args()
    args.seeds = [int(seed) for seed in (args.seeds or str(args.seed)).split(",")]
    args.pd, args.launcher_args = "", f"--engine sim --kv-cache-mib {args.kv_cache_mib}"
    return args


REPORT_LAG_S = 0.2  # a load report received this long after the last step was sent after it


def policy_list(text: str) -> str:
    """--policies: comma-separated dispatch:on|off pairs, each dispatch a policy the manager has; hands back the
    text. A typo is a usage error before the cluster starts (the manager refused it only after)."""
    for item in text.split(","):
        dispatch, _, migration = item.partition(":")
        if migration not in ("on", "off"):
            raise argparse.ArgumentTypeError(f"{item!r} is not dispatch:on or dispatch:off")
        if dispatch not in POLICY_NAMES:
            raise argparse.ArgumentTypeError(f"unknown dispatch policy {dispatch!r} (of {','.join(POLICY_NAMES)})")
    return text


def policies(spec: str) -> list[tuple[str, bool]]:
    return [(dispatch, migration == "on") for dispatch, _, migration in (item.partition(":") for item in spec.split(","))]


def salted(requests, salt: int):
    """The same requests with one leading token of their own: a run never hits what an earlier run cached
    (shared prefixes within the run still do)."""
    return [(at, [salt] + prompt, output_len) for at, prompt, output_len in requests]


async def prefix_cache_tokens(admin: ManagerClient, timeout_s: float = 30.0) -> tuple[int, int]:
    """(queried, hit) prompt tokens of every instance's prefix cache so far, from a load report of each that
    the leader received at least REPORT_LAG_S after this call began: after the last step (reports every 75 ms)."""
    asked_at = time.monotonic()
    while True:
        waited_s = time.monotonic() - asked_at
        infos = await admin.list_instances()
        if all(0 <= i.report_age_s <= waited_s - REPORT_LAG_S for i in infos):
            return (sum(i.prefix_cache_queried_tokens for i in infos), sum(i.prefix_cache_hit_tokens for i in infos))
        if waited_s > timeout_s:
            raise TimeoutError(f"no fresh load report of every instance after {timeout_s} s")
        await asyncio.sleep(0.05)


async def preemptions(metrics_urls: list[str]) -> int:
    """Preemptions so far, summed over the instances (their ferry_instance_preemptions counters)."""
    total = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in metrics_urls:
            async with session.get(url) as response:
                text = await response.text()
            total += sum(int(float(line.split()[-1])) for line in text.splitlines()
                         if line.startswith("ferry_instance_preemptions_total"))
    return total


def instance_metrics_urls(cluster: dict) -> list[str]:
    return [p["metrics_url"] for p in cluster["processes"] if p["name"].startswith("instance-")]


async def run_policy(admin: ManagerClient, cluster: dict, model: str, requests, dispatch: str, migrate: bool) -> dict:
    await admin.update_policy(dispatch=dispatch, migration_enabled=migrate)
    started_at = time.time()
    queried_before, hit_before = await prefix_cache_tokens(admin)
    preempted_before = await preemptions(instance_metrics_urls(cluster))
    results, elapsed = await run_workload(cluster["frontend_url"], model, requests)
    await admin.update_policy(migration_enabled=False)
    moved = await admin.list_migrations()
    queried, hit = await prefix_cache_tokens(admin)
    ok = [r for r in results if not r.error]
    mine = [m for m in moved.migrations if m.started_at >= started_at]
    return {"policy": f"{dispatch}:{'on' if migrate else 'off'}", "elapsed_s": elapsed,
            "prefix_hit_rate": (hit - hit_before) / max(queried - queried_before, 1),
            "num_preemptions": await preemptions(instance_metrics_urls(cluster)) - preempted_before,
            "ttft_ms": [r.ttft_ms for r in ok], "itl_ms": [gap for r in ok for gap in r.itl_ms],
            "num_migrations": sum(m.outcome == "committed" for m in mine),
            "migrations": [{"at_s": m.started_at - started_at, "src": m.src_instance_id, "dst": m.dst_instance_id,
                            "outcome": m.outcome, "reason": m.reason, "message": m.message, "num_blocks": m.num_blocks,
                            "duration_ms": m.duration_ms, "downtime_ms": m.downtime_ms} for m in mine],
            "num_errors": len(results) - len(ok), "errors": [r.error for r in results if r.error]}


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def with_ratios(runs: list[dict]) -> list[dict]:
    """Each run with its p99s over those of the first policy of the same seed (measured in the same session)."""
    first = {}
    for run in runs:
        first.setdefault(run["seed"], run)
    return [{**run, "ttft_vs_first": p99(run["ttft_ms"]) / p99(first[run["seed"]]["ttft_ms"]),
             "decode_vs_first": p99(run["itl_ms"]) / p99(first[run["seed"]]["itl_ms"])} for run in runs]


def report(runs: list[dict]) -> str:
    lines = ["seed\tpolicy\tttft_p50(ms)\tttft_p99(ms)\tdecode_p50(ms)\tdecode_p99(ms)\tmigrations\tpreemptions"
             "\terrors\tprefix_hit\tp99_ttft_vs_first\tp99_decode_vs_first"]
    for run in with_ratios(runs):
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        lines.append(f"{run['seed']}\t{run['policy']}\t{np.percentile(ttft, 50):.1f}\t{p99(ttft):.1f}\t"
                     f"{np.percentile(itl, 50):.1f}\t{p99(itl):.1f}\t{run['num_migrations']}\t{run['num_preemptions']}\t"
                     f"{run['num_errors']}\t{run['prefix_hit_rate']:.2f}\t{run['ttft_vs_first']:.2f}\t"
                     f"{run['decode_vs_first']:.2f}")
    return "\n".join(lines)


def summary(runs: list[dict]) -> str:
    """Per policy, the median over seeds of each figure (errors: the sum) and the range of each ratio."""
    lines = ["policy\tseeds\tttft_p50(ms)\tttft_p99(ms)\tdecode_p50(ms)\tdecode_p99(ms)\tmigrations\tpreemptions"
             "\terrors\tp99_ttft_vs_first\trange\tp99_decode_vs_first\trange"]
    rated = with_ratios(runs)
    for policy in dict.fromkeys(run["policy"] for run in rated):
        mine = [run for run in rated if run["policy"] == policy]
        medians = [np.median([figure(run) for run in mine]) for figure in (
            lambda r: np.percentile(r["ttft_ms"], 50), lambda r: p99(r["ttft_ms"]),
            lambda r: np.percentile(r["itl_ms"], 50), lambda r: p99(r["itl_ms"]))]
        counts = [np.median([run[key] for run in mine]) for key in ("num_migrations", "num_preemptions")]
        cells = [f"{value:.1f}" for value in medians] + [f"{value:g}" for value in counts]
        cells.append(str(sum(run["num_errors"] for run in mine)))
        for key in ("ttft_vs_first", "decode_vs_first"):
            ratios = [run[key] for run in mine]
            cells += [f"{np.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}"]
        lines.append(f"{policy}\t{len(mine)}\t" + "\t".join(cells))
    return "\n".join(lines)


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(run["policy"] for run in runs):
        for axis, key in zip(axes, ("ttft_ms", "itl_ms")):
            values = np.sort([value for run in runs if run["policy"] == policy for value in run[key]])
            axis.plot(values, np.arange(1, len(values) + 1) / len(values), label=policy)
    for axis, title in zip(axes, ("time to first token", "gap between tokens")):
        axis.set(xscale="log", xlabel="ms", ylabel="fraction of requests / gaps", title=title)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench(args: argparse.Namespace, cluster: dict) -> list[dict]:
    vocab_size = ModelConfig.from_dir(args.model).vocab_size
    runs, salt = [], 0
    async with ManagerClient(cluster["admin_address"], timeout_s=10.0) as admin:
        for seed in args.seeds:
            requests = workload(argparse.Namespace(**{**vars(args), "seed": seed}), vocab_size)
            for dispatch, migrate in policies(args.policies):
                salt += 1
                print(f"seed {seed}, policy {dispatch}, migration {'on' if migrate else 'off'}", flush=True)
                run = await run_policy(admin, cluster, args.model.name, salted(requests, salt), dispatch, migrate)
                runs.append({"seed": seed, **run})
                for error in run["errors"]:
                    print(f"error: {error}", file=sys.stderr)
    return runs


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    args.out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(FERRY_INSTANCE_MAX_NUM_SEQS=str(args.max_num_seqs), FERRY_INSTANCE_SIM_STEP_MS=str(args.sim_step_ms),
                      FERRY_INSTANCE_SIM_PREFILL_MS_PER_TOKEN=str(args.sim_prefill_ms_per_token))
    with started_cluster(args) as cluster:
        runs = asyncio.run(bench(args, cluster))
    print(report(runs))
    print(summary(runs))
    (args.out_dir / "policy_sim.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                              "runs": runs}))
    plot(runs, args.out_dir / "policy_sim.png")
    print(f"wrote {args.out_dir / 'policy_sim.json'} and {args.out_dir / 'policy_sim.png'}")


if __name__ == "__main__":
    main()
