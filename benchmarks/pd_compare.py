"""Prefill/decode disaggregation side by side: the same prefill-heavy workload (same seed,
same Poisson arrivals) against P prefill + D decode instances and against P + D `both`
instances, each on a fresh local cluster on this machine.

The workload mixes long prompts with short outputs (prefill-heavy) and short prompts with
long outputs (the decodes that a long prefill in the same batch stalls). For each variant
it prints the prefill (time to first token) and decode (inter-token latency) tables of
benchmarks/serving.py, the decode latency of the long decodes alone, and the hand-off
gap (first → second token: in PD this is where the request moves to its decode instance),
then the decode p99 ratio PD / both.

Variants (--variants, comma-separated):
    both        P + D instances with role both
    pd          P prefill + D decode, the prefill instance pushes each hand-off (default)
    pd-manager  the same with --pd-handoff manager (the manager's migration loop moves them)
    pd-short    pd with the short-prompt rule on (prompts under --short-prompt-tokens prefill on decode)
    pd-parked   pd with --pd-handoff-hold-s 86400: queued hand-offs stay parked however long they
                wait (the behaviour before that flag)

    python benchmarks/pd_compare.py --model models/smollm2-135m-instruct --pd 1:1 --num-requests 24 --rate 1

--freeze-decode AT:FOR freezes the last decode instance (SIGSTOP) AT seconds into the
workload for FOR seconds, a hung host; the worst pause of each stream (its longest gap
between two tokens) then shows what the others waited for it:

    python benchmarks/pd_compare.py --pd 1:2 --variants pd,pd-parked --freeze-decode 2:8 \\
        --num-requests 32 --rate 3 --launcher-args "--engine sim --kv-cache-mib 512"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import re
import signal
import sys
from collections.abc import Iterator

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.flags import HelpFormatter, above_zero, at_least, names_of, prefill_decode  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402
from benchmarks.serving import RequestResult, run_workload, started_cluster, table  # noqa: E402

VARIANTS = ("both", "pd", "pd-manager", "pd-short", "pd-parked")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "smollm2-135m-instruct",
                        help="model folder every instance serves")
    parser.add_argument("--pd", type=prefill_decode, default="1:1", help="P:D — prefill and decode instances (both-variant: P+D instances)")
    parser.add_argument("--variants", type=names_of(VARIANTS), default="both,pd,pd-manager",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--num-requests", type=at_least(1), default=24, help="requests sent to each variant")
    parser.add_argument("--rate", type=above_zero, default=1.0, help="mean arrival rate (requests/s, Poisson)")
    parser.add_argument("--long-prompt", type=int, default=384, help="prompt tokens of a prefill-heavy request")
    parser.add_argument("--short-output", type=int, default=8, help="output tokens of a prefill-heavy request")
    parser.add_argument("--decode-prompt", type=int, default=16, help="prompt tokens of a long-decode request")
    parser.add_argument("--long-output", type=int, default=96, help="output tokens of a long-decode request")
    parser.add_argument("--decode-fraction", type=float, default=0.3, help="share of long-decode requests")
    parser.add_argument("--short-prompt-tokens", type=int, default=64, help="pd-short: the rule's threshold")
    parser.add_argument("--launcher-args", default="--kv-cache-mib 512", help="extra flags for services.cluster up")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix and arrival times")
    parser.add_argument("--freeze-decode", type=at_for, default="", metavar="AT:FOR",
                        help="freeze the last decode instance AT s into the workload for FOR s (empty: no freeze)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench-results" / "pd_compare.json",
                        help="where the figures are written as JSON")
    return parser.parse_args()


def at_for(text: str) -> str:
    """--freeze-decode: AT:FOR in seconds, or empty; hands back the text."""
    if text and not re.fullmatch(r"\d+(\.\d+)?:\d+(\.\d+)?", text):
        raise argparse.ArgumentTypeError(f"want AT:FOR in seconds (e.g. 2:8), got {text!r}")
    return text


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, output length) from the seed alone: identical for every variant."""
    rng = random.Random(args.seed)
    requests, now = [], 0.0
    for _ in range(args.num_requests):
        now += rng.expovariate(args.rate)
        is_decode = rng.random() < args.decode_fraction
        prompt_len = args.decode_prompt if is_decode else int(args.long_prompt * rng.uniform(0.75, 1.25))
        output_len = args.long_output if is_decode else args.short_output
        requests.append((now, [rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)], output_len))
    return requests


@contextlib.contextmanager
def variant_cluster(args: argparse.Namespace, variant: str) -> Iterator[dict]:
    prefill, decode = (int(n) for n in args.pd.split(":"))
    env = {"FERRY_INSTANCE_PD_HANDOFF": "manager" if variant == "pd-manager" else "push",
           "FERRY_MANAGER_PD_SHORT_PROMPT_TOKENS": str(args.short_prompt_tokens if variant == "pd-short" else 0)}
    if variant == "pd-parked":
        env["FERRY_INSTANCE_PD_HANDOFF_HOLD_S"] = "86400"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the launcher's children inherit them
    spec = argparse.Namespace(model=args.model, launcher_args=args.launcher_args,
                              instances=prefill + decode, pd="" if variant == "both" else args.pd)
    try:
        with started_cluster(spec) as cluster:
            yield cluster
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


async def workload_with_freeze(args: argparse.Namespace, cluster: dict,
                               requests: list[tuple[float, list[int], int]]) -> tuple[list[RequestResult], float]:
    """The workload; with --freeze-decode, the last decode instance frozen meanwhile."""
    run = run_workload(cluster["frontend_url"], args.model.name, requests)
    if not args.freeze_decode:
        return await run
    at_s, for_s = (float(part) for part in args.freeze_decode.split(":"))
    prefill, decode = (int(n) for n in args.pd.split(":"))
    pid = next(p["pid"] for p in cluster["processes"] if p["name"] == f"instance-{prefill + decode - 1}")
    results, _ = await asyncio.gather(run, frozen(pid, at_s, for_s))
    return results


async def frozen(pid: int, at_s: float, for_s: float) -> None:
    await asyncio.sleep(at_s)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(for_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def summarize(variant: str, results: list[RequestResult], elapsed: float, long_output: int) -> dict:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_ms for r in ok]
    itl = [gap for r in ok for gap in r.itl_ms]
    long_itl = [gap for r in ok if r.output_len == long_output for gap in r.itl_ms[1:]]  # after the hand-off
    handoff = [r.itl_ms[0] for r in ok if r.itl_ms]
    worst_gap = [max(r.itl_ms) for r in ok if r.itl_ms]
    print(f"\n== {variant}: {len(ok)}/{len(results)} ok in {elapsed:.1f} s, "
          f"{sum(r.num_tokens for r in ok) / elapsed:.1f} output tokens/s")
    print(table("prefill", ttft))
    print(table("decode", itl))
    print(table("long-decode", long_itl))
    print(table("handoff-gap", handoff))
    print(table("worst-gap", worst_gap))
    return {"variant": variant, "num_errors": len(results) - len(ok), "elapsed_s": elapsed, "ttft_ms": ttft,
            "itl_ms": itl, "long_decode_itl_ms": long_itl, "handoff_gap_ms": handoff, "worst_gap_ms": worst_gap}


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def compare(summaries: dict[str, dict]) -> None:
    print("\nvariant\tttft p50\tttft p99\tdecode p50\tdecode p99\tlong-decode p99\thandoff-gap p50\thandoff-gap p99"
          "\tworst-gap p50\tworst-gap max")
    for name, s in summaries.items():
        print(f"{name}\t{p(s['ttft_ms'], 50):.1f}\t{p(s['ttft_ms'], 99):.1f}\t{p(s['itl_ms'], 50):.1f}\t"
              f"{p(s['itl_ms'], 99):.1f}\t{p(s['long_decode_itl_ms'], 99):.1f}\t{p(s['handoff_gap_ms'], 50):.1f}\t"
              f"{p(s['handoff_gap_ms'], 99):.1f}\t{p(s['worst_gap_ms'], 50):.1f}\t{p(s['worst_gap_ms'], 100):.1f}")
    if "pd" in summaries and "pd-parked" in summaries:
        print(f"worst-gap p50 ratio pd/pd-parked: "
              f"{p(summaries['pd']['worst_gap_ms'], 50) / p(summaries['pd-parked']['worst_gap_ms'], 50):.2f}")
    if "both" in summaries:
        base = summaries["both"]
        for name, s in summaries.items():
            if name != "both":
                print(f"decode p99 ratio {name}/both: {p(s['itl_ms'], 99) / p(base['itl_ms'], 99):.2f}\t"
                      f"long-decode p99 ratio: {p(s['long_decode_itl_ms'], 99) / p(base['long_decode_itl_ms'], 99):.2f}")


def main() -> None:
    from services.instance.engine.model_config import ModelConfig

    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    variants = args.variants.split(",")
    requests = workload(args, ModelConfig.from_dir(args.model).vocab_size)
    summaries = {}
    for variant in variants:
        with variant_cluster(args, variant) as cluster:
            results, elapsed = asyncio.run(workload_with_freeze(args, cluster, requests))
        summaries[variant] = summarize(variant, results, elapsed, args.long_output)
    compare(summaries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "variants": summaries}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
