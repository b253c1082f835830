"""benchmarks/serving.py's overhead line: the client's decode p50 minus the instances' step p50 weighted by
each step's tokens (the plain median beside it)."""

from __future__ import annotations

import argparse

import pytest

from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(60)


def test_a_negative_overhead_says_why(monkeypatch, capsys):
    """Tokens read in bursts (a tiny model's steps outpace the serving path) put the client's decode p50 below
    the instances' step p50: the overhead line marks the negative figure and --help explains it."""
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    bursty = serving.RequestResult(3, 5, ttft_ms=20.0, itl_ms=[0.01, 0.01, 0.01, 9.0], num_tokens=5)
    summary = serving.report(argparse.Namespace(), [bursty], 1.0, [serving.StepSample(1.7, 1.9)])
    assert summary["overhead_ms_p50"] < 0 and "(negative: tokens came in bursts, see --help)" in capsys.readouterr().out
    assert "bursts" in serving.__doc__


def test_the_overhead_is_taken_against_the_token_weighted_step(monkeypatch, capsys):
    """Long steps carry big batches: the median token waited a 29 ms step while the median step took 12 ms. Against
    the plain median the path seemed to add 18 ms per token; it added 1."""
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    tokens = serving.RequestResult(3, 7, ttft_ms=20.0, itl_ms=[11.0, 11.0, 30.0, 30.0, 30.0, 30.0], num_tokens=7)
    summary = serving.report(argparse.Namespace(), [tokens], 1.0,
                             [serving.StepSample(12.0, 29.0), serving.StepSample(12.0, 29.0)])
    out = capsys.readouterr().out
    assert summary["overhead_ms_p50"] == pytest.approx(1.0)
    assert summary["overhead_vs_plain_step_ms_p50"] == pytest.approx(18.0)
    assert "instance step p50 token-weighted 29.00 ms (plain 12.00 ms)\tadded 1.00 ms/token" in out


def test_instances_that_report_no_token_weighted_step_fall_back_to_the_plain_one(monkeypatch, capsys):
    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    tokens = serving.RequestResult(3, 4, ttft_ms=20.0, itl_ms=[14.0, 14.0, 14.0], num_tokens=4)
    summary = serving.report(argparse.Namespace(), [tokens], 1.0, [serving.StepSample(12.0, 0.0)])
    assert summary["overhead_ms_p50"] == pytest.approx(2.0)
    assert "instance step p50 12.00 ms (plain: the instances report no token-weighted one)" in capsys.readouterr().out


def test_an_instance_that_took_no_step_since_the_last_sample_is_not_sampled_again(monkeypatch):
    """Its window still holds its last busy steps: sampled every 3 s while idle, those outweighed the busy instance's
    (a run's tail: one instance idle for a minute gave a third of the samples)."""
    from services.common.gen.ferry.v1 import common_pb2

    serving = load_benchmark(ROOT / "benchmarks" / "serving.py", monkeypatch)
    seen: dict[str, int] = {}

    def load(instance_id: str, num_steps: int, plain: float) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=instance_id, num_steps=num_steps, step_time_ms_p50=plain,
                                     step_time_ms_token_weighted_p50=plain + 1)
    first = serving.fresh_step_samples([load("i-0", 10, 40.0), load("i-1", 0, 0.0)], seen)
    assert first == [serving.StepSample(40.0, 41.0)]  # i-1 never stepped
    again = serving.fresh_step_samples([load("i-0", 10, 40.0), load("i-1", 5, 30.0)], seen)
    assert again == [serving.StepSample(30.0, 31.0)]  # i-0 idle since
