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


def test_every_script_answers_help_without_doing_its_work():
    # before, `python scripts/gen_proto.py --help` regenerated services/common/gen instead
    for script in sorted((ROOT / "scripts").glob("*.py")):
        result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60,
                                cwd=ROOT)
        assert result.returncode == 0 and result.stdout.startswith("usage:"), (script.name, result.stdout[:200])
