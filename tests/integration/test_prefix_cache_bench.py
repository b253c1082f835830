"""The prefix caching benchmark in its smallest form: a tiny model, the table it prints, and its
check that the cache changes no token."""

from __future__ import annotations


import pytest

from tests.integration.benchmark_run import run_benchmark


@pytest.mark.timeout(200)
def test_prints_both_modes_and_equal_tokens():
    lines = run_benchmark("prefix_cache.py", "--tiny", "--threads", "1", "--prefix-len", "64",
                          "--suffix-len", "8", "--num-requests", "3", timeout_s=180)
    header = lines.index("mode\tttft_p50(ms)\thit_rate\tttft_vs_off")
    off, on = (line.split("\t") for line in lines[header + 1:header + 3])
    assert off[0] == "off" and off[2] == "0.00" and off[3] == "1.00"
    assert on[0] == "on" and float(on[2]) > 0.5  # 64 of every 72 prompt tokens after the first request
    assert "tokens equal with and without the cache: yes" in lines
