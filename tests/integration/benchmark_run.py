"""Running a benchmark script the way a user does (`python benchmarks/<name>.py ...` from the
repository root) and handing back what it printed; its stderr tail where it fails."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout_s: float = 180, tmp_dir: pathlib.Path | None = None) -> list[str]:
    """The stdout lines of `benchmarks/<script>` run with `args` (temporary files under `tmp_dir`, if
    given); fails the test on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"TMPDIR": str(tmp_dir)} if tmp_dir else {})}
    completed = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.splitlines()
