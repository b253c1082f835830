"""`make lint` stays clean: ruff (pyflakes, pycodestyle, bugbear; settings in pyproject.toml)
over every Python file of the project, so `make test` fails on an unused import, an undefined
name or a mutable default as soon as it is written."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent))

pytestmark = pytest.mark.timeout(60)


def test_ruff_finds_nothing():
    assert RUFF is not None, "ruff is missing from the venv: it is pinned in pyproject's test extra (make install)"
    completed = subprocess.run([RUFF, "check", "services", "benchmarks", "tests", "scripts"], cwd=ROOT,
                               capture_output=True, text=True, timeout=50)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
