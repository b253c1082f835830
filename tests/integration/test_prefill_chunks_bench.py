"""The prefill chunk benchmark in its smallest form: a tiny model, a row per chunk size."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_run import run_benchmark


@pytest.mark.timeout(200)
def test_prints_a_row_per_chunk_size_with_ratios_against_the_first():
    lines = run_benchmark("prefill_chunks.py", "--tiny", "--threads", "1", "--long-len", "900",
                          "--short-lens", "20,60", "--decodes", "2", "--repeats", "1", timeout_s=180)
    header = lines.index("chunk\tshort_ttft_p50_ms\tshort_ttft_max_ms\tlong_ttft_ms\tstep_p50_ms")
    rows = [line.split("\t") for line in lines[header + 1:header + 5]]
    assert [row[0] for row in rows] == ["full (448)", "half (224)", "128 (128)", "budget-end (None)"]
    assert all(cell.endswith("x)") for row in rows for cell in row[1:])
    assert all(cell.endswith("(1.00x)") for cell in rows[0][1:])
