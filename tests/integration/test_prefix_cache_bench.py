"""The prefix caching benchmark in its smallest form: a tiny model, the table it prints, and its
check that the cache changes no token."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_prints_both_modes_and_equal_tokens():
    completed = subprocess.run(
        [sys.executable, "benchmarks/prefix_cache.py", "--tiny", "--threads", "1", "--prefix-len", "64",
         "--suffix-len", "8", "--num-requests", "3"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    header = lines.index("mode\tttft_p50(ms)\thit_rate\tttft_vs_off")
    off, on = (line.split("\t") for line in lines[header + 1:header + 3])
    assert off[0] == "off" and off[2] == "0.00" and off[3] == "1.00"
    assert on[0] == "on" and float(on[2]) > 0.5  # 64 of every 72 prompt tokens after the first request
    assert "tokens equal with and without the cache: yes" in completed.stdout
