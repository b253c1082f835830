"""Running a benchmark script the way a user does (`python benchmarks/<name>.py ...` from the
repository root) and handing back what it printed; its stderr tail where it fails."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout_s: float = 180) -> list[str]:
    """The stdout lines of `benchmarks/<script>` run with `args`; fails the test on a non-zero exit."""
    completed = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=timeout_s)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.splitlines()
