"""The resume recompute benchmark in its smallest form: a tiny model, a row per resumed count,
both ways timed."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_run import run_benchmark


@pytest.mark.timeout(200)
def test_prints_a_row_per_resumed_count_with_both_ways():
    lines = run_benchmark("resume_recompute.py", "--tiny", "--threads", "1", "--prompt-len", "30",
                          "--resumed", "5,20", "--repeats", "1", timeout_s=180)
    header = lines.index("resumed_tokens\tone_by_one_ms\tone_prefill_ms\tratio")
    rows = [line.split("\t") for line in lines[header + 1:header + 3]]
    assert [row[0] for row in rows] == ["5", "20"]
    assert all(float(row[1]) >= 0 and float(row[2]) >= 0 and row[3].endswith("x") for row in rows)
