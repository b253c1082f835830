"""The structured output benchmark in its smallest form: a tiny model, both runs decode every
token, and the figures it prints."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_prints_free_and_guided_step_times_over_the_same_tokens():
    completed = subprocess.run(
        [sys.executable, "benchmarks/structured_output.py", "--tiny", "--threads", "1", "--batch", "3",
         "--output-len", "12", "--fields", "4"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "tokens generated\tfree 36\tguided 36" in completed.stdout
    assert re.search(r"decode step ms \(median\)\tfree [\d.]+\tguided [\d.]+\tguided/free [\d.]+x", completed.stdout)
    assert re.search(r"grammar work per request and token \(mask \+ accept, mean\)\t\d+ us", completed.stdout)
