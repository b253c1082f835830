"""Profile the torch engine on a model and print the sim engine's latency model for it.

    python -m services.instance.engine.sim_profile --model DIR [--dtype bfloat16]

Times real engine steps and fits the sim's three terms:

* decode: steps of B sequences decoding one token each, at B = 1 and B = --batch-size:
  `decode_ms_per_seq` is the slope, `step_ms` what is left at B = 0;
* prefill: one sequence's prompt of --prompt-tokens in one step, and of a quarter of that:
  `prefill_ms_per_token` is the slope.

Each figure is the median of --repeats steps. Prints the flags for `services.instance
--engine sim` (and the same as FERRY_INSTANCE_* variables, which `services.cluster up`
passes on to its instances).
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import time
import uuid

import torch
from tqdm import tqdm

from services.common.config import DefaultsHelpFormatter
from services.instance.engine.engine import LLMEngine
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams
from services.instance.engine.sim_model import SimLatency

_PROMPT_TOKEN = 100  # any id


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.instance.engine.sim_profile", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, required=True, help="Hugging Face model folder to profile")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights and KV cache dtype, as the instance's --dtype")
    parser.add_argument("--batch-size", type=int, default=16, help="the larger decode batch of the fit")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the longer prompt of the fit")
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per point (the median counts)")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.batch_size < 2 or args.prompt_tokens < 8 or args.repeats < 1:
        parser.error("--batch-size must be >= 2, --prompt-tokens >= 8 and --repeats >= 1")
    return args


def profile(engine: LLMEngine, batch_size: int, prompt_tokens: int, repeats: int) -> SimLatency:
    """Fit the sim's latency model to timed steps of `engine` (which must be idle)."""
    points = [("decode", 1), ("decode", batch_size), ("prefill", prompt_tokens // 4), ("prefill", prompt_tokens)]
    with tqdm(total=len(points) * repeats, desc="profiling steps", unit="step") as progress:
        times = {point: _median_step_s(engine, *point, repeats, progress) for point in points}
    per_seq = (times["decode", batch_size] - times["decode", 1]) / (batch_size - 1)
    step = times["decode", 1] - per_seq
    per_token = (times["prefill", prompt_tokens] - times["prefill", prompt_tokens // 4]) / (prompt_tokens
                                                                                          - prompt_tokens // 4)
    return SimLatency(step_ms=max(0.0, step) * 1e3, prefill_ms_per_token=max(0.0, per_token) * 1e3,
                      decode_ms_per_seq=max(0.0, per_seq) * 1e3)


_ids = itertools.count()


def _median_step_s(engine: LLMEngine, kind: str, size: int, repeats: int, progress: tqdm) -> float:
    times = []
    for _ in range(repeats):
        times.append(_decode_step_s(engine, size) if kind == "decode" else _prefill_step_s(engine, size))
        progress.update()
    return statistics.median(times)


def _prefill_step_s(engine: LLMEngine, num_tokens: int) -> float:
    """One step that prefills a `num_tokens` prompt (it also samples its first token)."""
    engine.add_request(f"profile-{next(_ids)}", _prompt(engine, num_tokens),
                       SamplingParams(temperature=0.0, max_tokens=1))
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    _drain(engine)
    return elapsed


def _decode_step_s(engine: LLMEngine, num_seqs: int) -> float:
    """One step in which `num_seqs` sequences (16-token prompts, already prefilled) decode a token each."""
    for _ in range(num_seqs):
        engine.add_request(f"profile-{next(_ids)}", _prompt(engine, 16),
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefills (and first tokens)
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    _drain(engine)
    return elapsed


def _prompt(engine: LLMEngine, num_tokens: int) -> list[int]:
    """A prompt unlike the ones before (its first token differs), so no prefix cache hit shortens its prefill."""
    return [next(_ids) % engine.vocab_size] + [_PROMPT_TOKEN % engine.vocab_size] * (num_tokens - 1)


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def flags(latency: SimLatency) -> str:
    return (f"--engine sim --sim-step-ms {latency.step_ms:.3f} --sim-prefill-ms-per-token "
            f"{latency.prefill_ms_per_token:.4f} --sim-decode-ms-per-seq {latency.decode_ms_per_seq:.4f}")


def env_lines(latency: SimLatency) -> str:
    return "\n".join([f"FERRY_INSTANCE_SIM_STEP_MS={latency.step_ms:.3f}",
                      f"FERRY_INSTANCE_SIM_PREFILL_MS_PER_TOKEN={latency.prefill_ms_per_token:.4f}",
                      f"FERRY_INSTANCE_SIM_DECODE_MS_PER_SEQ={latency.decode_ms_per_seq:.4f}"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    spec = EngineSpec(args.model, kv_name=f"ferry-sim-profile-{uuid.uuid4().hex[:8]}", dtype=getattr(torch, args.dtype),
                      num_blocks=max(64, args.batch_size * 2 + args.prompt_tokens // 16 + 8),
                      max_num_seqs=args.batch_size, max_num_batched_tokens=max(args.prompt_tokens, args.batch_size * 16))
    loaded = build_engine(spec)
    try:
        latency = profile(loaded.engine, args.batch_size, args.prompt_tokens, args.repeats)
    finally:
        loaded.close()
    print(flags(latency))
    print(env_lines(latency))


if __name__ == "__main__":
    main()
