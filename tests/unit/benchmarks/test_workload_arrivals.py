"""The benchmark workload's arrivals: --burstiness 1 sends what the Poisson workload always sent (same
seed, same offsets), and below 1 the gaps keep their mean (the rate) while they vary more, as vLLM's
benchmark_serving --burstiness (Gamma gaps, coefficient of variation 1/sqrt(burstiness))."""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(60)


def args(burstiness: float, num_requests: int = 4000) -> argparse.Namespace:
    return argparse.Namespace(seed=3, num_requests=num_requests, rate=6.0, burstiness=burstiness, prompt_mean=8,
                              output_mean=8, sigma=0.5, max_prompt=64, max_output=64, num_prefixes=0, prefix_len=0)


def gaps(requests) -> np.ndarray:
    return np.diff([0.0] + [at for at, _, _ in requests])


def test_burstiness_one_is_the_poisson_workload(monkeypatch):
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    rng, now, poisson = random.Random(3), 0.0, []
    for _ in range(50):  # what workload() drew before --burstiness: expovariate, then the two lengths
        now += rng.expovariate(6.0)
        prompt_len = min(64, max(4, int(rng.lognormvariate(np.log(8), 0.5))))
        rng.lognormvariate(np.log(8), 0.5)
        [rng.randrange(100, 900) for _ in range(prompt_len)]
        poisson.append(now)
    assert [at for at, _, _ in serving.workload(args(1.0, num_requests=50), 1000)] == poisson


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gaps_keep_the_rate_and_vary_by_one_over_sqrt_burstiness(burstiness, cv, monkeypatch):
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    found = gaps(serving.workload(args(burstiness), 1000))
    assert found.mean() == pytest.approx(1 / 6.0, rel=0.1)
    assert found.std() / found.mean() == pytest.approx(cv, rel=0.15)
