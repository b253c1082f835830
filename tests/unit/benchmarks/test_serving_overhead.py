"""benchmarks/serving.py's overhead line: the client's decode p50 minus the instances' step p50."""

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
    summary = serving.report(argparse.Namespace(), [bursty], 1.0, [1.7])
    assert summary["overhead_ms_p50"] < 0 and "(negative: tokens came in bursts, see --help)" in capsys.readouterr().out
    assert "bursts" in serving.__doc__
