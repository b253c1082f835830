"""Prefix caching on one engine: time to first token of requests that share a prefix, cache on vs off.

Every request is one shared prefix of --prefix-len tokens (a system prompt, few-shot examples)
followed by --suffix-len tokens of its own. Requests run one after another, each alone in the
engine, once with prefix caching off and once on (the reference, measured in the same run).
The first request of each mode computes the prefix either way and is left out of the median.
Prints the median time to first token of each mode, the hit rate and the ratio on/off, and
checks that both modes generated the same tokens:

    mode  ttft_p50(ms)  hit_rate  ttft_vs_off
    off   ...
    on    ...

    PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py                # SmolLM2-135M
    PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py --tiny        # a tiny random model
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmarks/engine.py, also when imported

from services.instance.engine.engine import LLMEngine  # noqa: E402
from services.instance.engine.factory import EngineSpec, build_engine  # noqa: E402
from services.instance.engine.model_config import ModelConfig  # noqa: E402
from services.instance.engine.request import SamplingParams  # noqa: E402
from engine import add_model_args, model_dir_of  # noqa: E402  (benchmarks/engine.py)
from benchmarks.flags import HelpFormatter  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of the shared prefix")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own part")
    parser.add_argument("--output-len", type=int, default=8, help="tokens each request generates (compared)")
    parser.add_argument("--num-requests", type=int, default=9, help="requests per mode (the first is left out)")
    args = parser.parse_args()
    if args.num_requests < 2 or args.prefix_len < 1 or args.suffix_len < 1 or args.output_len < 1:
        parser.error("--num-requests must be >= 2; --prefix-len, --suffix-len and --output-len >= 1")
    return args


def prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, vocab_size - 10, (args.prefix_len,), generator=generator).tolist()
    return [prefix + torch.randint(10, vocab_size - 10, (args.suffix_len,), generator=generator).tolist()
            for _ in range(args.num_requests)]


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """(ms to the first token, every token) of one request alone in the engine."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    started, ttft_ms, tokens = time.perf_counter(), 0.0, []
    while engine.has_unfinished():
        for output in engine.step():
            if not tokens and output.new_token_ids:
                ttft_ms = (time.perf_counter() - started) * 1000
            tokens += output.new_token_ids
    return ttft_ms, tokens


def run_mode(args: argparse.Namespace, model_dir: pathlib.Path, enabled: bool,
             requests: list[list[int]]) -> tuple[list[float], list[list[int]], float]:
    """TTFTs (ms), tokens and hit rate of every request, with prefix caching `enabled` or not."""
    spec = EngineSpec(model_dir, kv_name=f"ferry-bench-prefix-{time.monotonic_ns()}", kv_cache_mib=256,
                      enable_prefix_caching=enabled)
    loaded = build_engine(spec)
    try:
        ttfts, outputs = [], []
        for i, prompt in enumerate(tqdm(requests, desc=f"prefix caching {'on' if enabled else 'off'}", unit="req")):
            ttft_ms, tokens = run_one(loaded.engine, f"r{i}", prompt, args.output_len)
            ttfts.append(ttft_ms)
            outputs.append(tokens)
        return ttfts, outputs, loaded.engine.prefix_cache_stats().hit_rate
    finally:
        loaded.close()


def report(results: dict[str, tuple[list[float], list[list[int]], float]]) -> str:
    medians = {mode: statistics.median(ttfts[1:]) for mode, (ttfts, _, _) in results.items()}
    lines = ["mode\tttft_p50(ms)\thit_rate\tttft_vs_off"]
    for mode, (_, _, hit_rate) in results.items():
        lines.append(f"{mode}\t{medians[mode]:.1f}\t{hit_rate:.2f}\t{medians[mode] / medians['off']:.2f}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_of(args, tmp)
        requests = prompts(args, ModelConfig.from_dir(model_dir).vocab_size)
        results = {mode: run_mode(args, model_dir, mode == "on", requests) for mode in ("off", "on")}
    print(report(results))
    same = results["off"][1] == results["on"][1]
    print(f"tokens equal with and without the cache: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
