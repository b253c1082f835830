"""Short prompts behind a long one: time to first token for each prefill chunk size.

Prefill chunks end at fixed multiples of a chunk size, so a prompt gets the same bits alone and
in a busy batch (scheduler.py). A chunk that does not fit in what a step has left waits a step.
This measures what that costs short prompts that arrive while a long prompt prefills:

  * --decodes streams are decoding;
  * a --long-len prompt arrives and takes its first chunk;
  * prompts of --short-lens tokens arrive together one step later.

Each chunk size in --chunks runs the same scene on the same engine: `half` is the default (half
of what a step leaves beside a full batch of decodes, in whole blocks), `full` all of that (the
default before 2026-12-06), `budget-end` the cut where the step's budget ends (before fixed
chunks: not batch-invariant), or a number of tokens.
Prints, per chunk size, the shorts' time to first token (median and worst), the long prompt's,
and the median step, each with its ratio to the first chunk size listed; medians of --repeats.

    python benchmarks/prefill_chunks.py --model models/smollm2-135m-instruct
    python benchmarks/prefill_chunks.py --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.flags import HelpFormatter, at_least, int_list, names_or_ints  # noqa: E402
from engine import add_model_args, greedy, model_dir_of, prompts  # noqa: E402

from services.instance.engine.factory import EngineSpec, build_engine  # noqa: E402
from services.instance.engine.scheduler import prefill_chunk_size  # noqa: E402

BUDGET_END = "budget-end"
HALF = "half"
FULL = "full"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_model_args(parser)
    parser.add_argument("--chunks", type=names_or_ints((HALF, FULL, BUDGET_END)), default=f"{FULL},{HALF},128,{BUDGET_END}",
                        help=f"comma-separated prefill chunk sizes: tokens, {HALF} (the default), {FULL} (the "
                             f"default before) or {BUDGET_END}; ratios are against the first")
    parser.add_argument("--long-len", type=at_least(1), default=2000, help="tokens of the long prompt")
    parser.add_argument("--short-lens", type=int_list(1), default="40,100,200,300", help="comma-separated tokens of the short prompts")
    parser.add_argument("--decodes", type=at_least(0), default=4, help="streams decoding throughout")
    parser.add_argument("--max-num-batched-tokens", type=at_least(1), default=512, help="the step's token budget")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="runs of each chunk size (medians reported)")
    return parser.parse_args()


@dataclass(frozen=True, slots=True)
class Scene:
    short_ttfts: list[float]  # seconds, one per short prompt
    long_ttft: float
    step_s: float  # median step while the prompts prefilled


def run_scene(engine, args: argparse.Namespace, tag: str) -> Scene:
    vocab = engine.vocab_size
    decode_ids = [f"{tag}-d{i}" for i in range(args.decodes)]
    for index, request_id in enumerate(decode_ids):
        engine.add_request(request_id, prompts(1, 16, vocab, seed=index)[0], greedy(100_000))
    while any(engine.scheduler.waiting) or any(r.num_uncomputed_tokens > 1 for r in engine.scheduler.running):
        engine.step()
    added: dict[str, float] = {}
    first_token: dict[str, float] = {}
    long_id = f"{tag}-long"
    added[long_id] = time.perf_counter()
    engine.add_request(long_id, prompts(1, args.long_len, vocab, seed=100)[0], greedy(1))
    step_times = [_step(engine, first_token)]
    for index, length in enumerate(int(n) for n in args.short_lens.split(",")):
        request_id = f"{tag}-s{index}"
        added[request_id] = time.perf_counter()
        engine.add_request(request_id, prompts(1, length, vocab, seed=200 + index)[0], greedy(1))
    while not added.keys() <= first_token.keys():
        step_times.append(_step(engine, first_token))
    for request_id in decode_ids:
        engine.abort(request_id)
    while engine.scheduler.has_unfinished():
        engine.step()
    shorts = [first_token[r] - added[r] for r in added if r != long_id]
    return Scene(shorts, first_token[long_id] - added[long_id], statistics.median(step_times))


def _step(engine, first_token: dict[str, float]) -> float:
    start = time.perf_counter()
    outputs = engine.step()
    now = time.perf_counter()
    for output in outputs:
        if output.new_token_ids:
            first_token.setdefault(output.request_id, now)
    return now - start


def chunk_of(text: str, engine) -> int | None:
    """--chunks' `text` as the scheduler's prefill_chunk_tokens."""
    config = engine.config
    if text == BUDGET_END:
        return None
    if text in (HALF, FULL):
        half = prefill_chunk_size(config.max_num_batched_tokens, config.max_num_seqs, config.block_size)
        full = prefill_chunk_size(config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                                  (config.max_num_batched_tokens - config.max_num_seqs) // config.block_size
                                  * config.block_size)
        return half if text == HALF else full
    return int(text)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_of(args, tmp)
        loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-bench-chunks-{time.monotonic_ns()}",
                                         kv_cache_mib=512, max_num_batched_tokens=args.max_num_batched_tokens,
                                         enable_prefix_caching=False))
        try:
            engine = loaded.engine
            engine.generate([prompts(1, 8, engine.vocab_size)[0]], greedy(2))  # warm up
            for chunk in args.chunks.split(","):
                engine.scheduler.prefill_chunk_tokens = chunk_of(chunk, engine)
                scenes = [run_scene(engine, args, f"c{chunk}-{i}") for i in range(args.repeats)]
                rows.append((f"{chunk} ({engine.scheduler.prefill_chunk_tokens})", statistics.median(statistics.median(s.short_ttfts) for s in scenes),
                             statistics.median(max(s.short_ttfts) for s in scenes),
                             statistics.median(s.long_ttft for s in scenes),
                             statistics.median(s.step_s for s in scenes)))
        finally:
            loaded.close()
    print(f"\nmodel: {model_dir.name}  threads: {torch.get_num_threads()}  long: {args.long_len} tokens  "
          f"shorts: {args.short_lens}  decodes: {args.decodes}  budget: {args.max_num_batched_tokens}")
    print("chunk\tshort_ttft_p50_ms\tshort_ttft_max_ms\tlong_ttft_ms\tstep_p50_ms")
    reference = rows[0]
    for chunk, *figures in rows:
        cells = [f"{value * 1000:.0f} ({value / base:.2f}x)" for value, base in zip(figures, reference[1:])]
        print("\t".join([chunk, *cells]))


if __name__ == "__main__":
    main()
