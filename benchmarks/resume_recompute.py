"""What an exact resume costs: output tokens computed again one by one (as their decode steps
did, the same bits) against one prefill of them (the reference, other bits).

A request resumes with --resumed tokens already generated after a --prompt-len prompt; the
figure is the time from admission to its next token, both ways on the same engine in the
same run (the scheduler's `recomputes_one_by_one` switched off for the reference), medians
of --repeats.

    python benchmarks/resume_recompute.py --model models/smollm2-135m-instruct
    python benchmarks/resume_recompute.py --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.flags import HelpFormatter, at_least, int_list  # noqa: E402
from engine import add_model_args, greedy, model_dir_of, prompts  # noqa: E402

from services.instance.engine.factory import EngineSpec, build_engine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompt-len", type=at_least(1), default=200, help="prompt tokens of the resumed request")
    parser.add_argument("--resumed", type=int_list(1), default="50,300", help="comma-separated counts of tokens already generated")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="runs of each (median reported)")
    return parser.parse_args()


def time_to_next_token(engine, prompt: list[int], resumed: list[int], request_id: str) -> float:
    """Seconds from admitting the resumed request to its next token."""
    engine.add_request(request_id, prompt, greedy(len(resumed) + 2), resume_token_ids=resumed)
    start = time.perf_counter()
    while not any(o.new_token_ids for o in engine.step()):
        pass
    elapsed = time.perf_counter() - start
    engine.abort(request_id)
    return elapsed


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_of(args, tmp)
        loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-bench-resume-{time.monotonic_ns()}",
                                         kv_cache_mib=512, max_num_batched_tokens=512, enable_prefix_caching=False))
        try:
            engine, rows = loaded.engine, []
            engine.generate([prompts(1, 8, engine.vocab_size)[0]], greedy(2))  # warm up
            for num_resumed in (int(n) for n in args.resumed.split(",")):
                prompt = prompts(1, args.prompt_len, engine.vocab_size, seed=num_resumed)[0]
                resumed = prompts(1, num_resumed, engine.vocab_size, seed=num_resumed + 1)[0]
                figures = {}
                for one_by_one in (True, False):
                    engine.scheduler.recomputes_one_by_one = one_by_one
                    figures[one_by_one] = statistics.median(
                        time_to_next_token(engine, prompt, resumed, f"r{num_resumed}-{one_by_one}-{i}")
                        for i in range(args.repeats))
                engine.scheduler.recomputes_one_by_one = True
                rows.append((num_resumed, figures[True], figures[False]))
        finally:
            loaded.close()
    print(f"\nmodel: {model_dir.name}  threads: {torch.get_num_threads()}  prompt: {args.prompt_len} tokens")
    print("resumed_tokens\tone_by_one_ms\tone_prefill_ms\tratio")
    for num_resumed, exact, prefill in rows:
        print(f"{num_resumed}\t{exact * 1000:.0f}\t{prefill * 1000:.0f}\t{exact / prefill:.2f}x")


if __name__ == "__main__":
    main()
