"""How many long requests a KV cache runs at once when every layer has a sliding window: the blocks behind
each request's window given back (block_manager.py) against kept, as before they were given back.

The sim engine (no weights; block use is the real engine's) serves --model's config.json with a window of
--window tokens on every layer, then the same config without a window (every block kept). --requests
requests of --prompt-len + --max-tokens tokens arrive at once in a cache of --num-blocks blocks; the figures
are the requests running in a step (mean over the steps), the preemptions, and the steps to finish them all.

    python benchmarks/window_capacity.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flags import HelpFormatter, at_least  # noqa: E402

from services.instance.engine.engine import LLMEngine  # noqa: E402
from services.instance.engine.engine_config import EngineConfig  # noqa: E402
from services.instance.engine.kv_cache import KvCache, KvGeometry  # noqa: E402
from services.instance.engine.model_config import ModelConfig  # noqa: E402
from services.instance.engine.request import SamplingParams  # noqa: E402
from services.instance.engine.sim_model import SimLatency, SimModel  # noqa: E402
from services.instance.engine.tokenizer import Tokenizer  # noqa: E402

NO_LATENCY = SimLatency(step_ms=0.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"),
                        help="Hugging Face model folder (its config.json and tokenizer; no weights are read)")
    parser.add_argument("--window", type=at_least(1), default=128, help="sliding window on every layer, in tokens")
    parser.add_argument("--num-blocks", type=at_least(1), default=96, help="KV cache blocks")
    parser.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    parser.add_argument("--requests", type=at_least(1), default=16, help="requests, all arriving at once")
    parser.add_argument("--prompt-len", type=at_least(1), default=64, help="prompt tokens of each request")
    parser.add_argument("--max-tokens", type=at_least(1), default=448, help="output tokens of each request")
    return parser.parse_args()


def run(config: ModelConfig, tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, float]:
    geometry = KvGeometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, args.block_size,
                          args.num_blocks, torch.float32)
    cache = KvCache.create(f"ferry-kv-bench-window-{os.getpid()}", geometry)
    try:
        engine = LLMEngine(SimModel(config, NO_LATENCY), tokenizer, cache, EngineConfig(
            num_blocks=args.num_blocks, max_model_len=args.prompt_len + args.max_tokens, block_size=args.block_size,
            max_num_seqs=args.requests, enable_prefix_caching=False))
        sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.requests):
            engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)], sampling)
        num_running, num_steps = 0, 0
        while engine.has_unfinished():
            engine.step()
            num_steps += 1
            num_running += len(engine.scheduler.running)
        return {"running a step": num_running / num_steps, "preemptions": engine.scheduler.num_preemptions,
                "steps": num_steps}
    finally:
        cache.close()
        cache.unlink()


def main() -> None:
    args = parse_args()
    config, tokenizer = ModelConfig.from_dir(args.model), Tokenizer.from_dir(args.model)
    windowed = dataclasses.replace(config, layer_windows=(args.window,) * config.num_hidden_layers)
    kept = dataclasses.replace(config, layer_windows=(None,) * config.num_hidden_layers)
    print(f"{args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens, window {args.window}, "
          f"{args.num_blocks} blocks of {args.block_size}")
    given_back, before = run(windowed, tokenizer, args), run(kept, tokenizer, args)
    for name in given_back:
        print(f"{name:>14}: {before[name]:>7.1f} blocks kept, {given_back[name]:>7.1f} given back "
              f"({given_back[name] / max(before[name], 1):.2f}x)")


if __name__ == "__main__":
    main()
