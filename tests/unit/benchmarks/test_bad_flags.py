"""A benchmark given flags it cannot run with says which flag and why, and exits 2 (argparse's
usage error) before it starts anything; before, these ran into a traceback (an IndexError for a
--max-mb below one block, a StatisticsError after a whole run with --repeats 0, an
AttributeError while closing services that never started for --backends nccl on a CPU).

Each case is checked in-process, in the script's parse_args (the refusal is argparse's); one case a script
runs as a real process, to show that its main() refuses before it starts anything. Ten processes took 60 s
of a loaded unit run (the five migration_speed.py ones 7-11 s each: it imports torch before its flags)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.torch_children import TORCH_CHILD_TIMEOUT_S
from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(TORCH_CHILD_TIMEOUT_S + 30)  # migration_speed.py imports torch before its flags

CASES = [
    ("migration_speed.py", ["--max-mb", "4"], "--max-mb 4: the smallest migration is one 8 MB block"),
    ("migration_speed.py", ["--repeats", "0"], "--repeats 0: at least 1"),
    ("migration_speed.py", ["--backends", "grpc,foo"], "--backends: unknown foo"),
    ("migration_speed.py", ["--layouts", "diagonal"], "--layouts: unknown diagonal"),
    ("migration_speed.py", ["--backends", "nccl"], "--backends nccl needs --kv-device cuda"),
    ("migration_downtime.py", ["--lengths", "256,8k"], "--lengths 256,8k: comma-separated token counts"),
    ("migration_downtime.py", ["--lengths", "8,256"], "8 is too short"),
    ("migration_downtime.py", ["--repeats", "0"], "--repeats 0: at least 1"),
    ("dispatch.py", ["--rate", "0"], "--rate 0: must be above 0"),
    ("dispatch.py", ["--policy", "fastest"], "invalid choice: 'fastest'"),
]


@pytest.mark.parametrize(("script", "flags", "message"), CASES, ids=[f"{s}{' '.join(f)}" for s, f, _ in CASES])
def test_bad_flags_are_a_usage_error(script, flags, message, tmp_path, monkeypatch, capsys):
    bench = load_benchmark(ROOT / "benchmarks" / script, monkeypatch)
    monkeypatch.setattr(sys, "argv", [script, *flags, *out_dir(script, tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no temporary folder, no output


ONE_CASE_A_SCRIPT = [next(case for case in CASES if case[0] == script) for script in dict.fromkeys(c[0] for c in CASES)]


@pytest.mark.parametrize(("script", "flags", "message"), ONE_CASE_A_SCRIPT, ids=[s for s, _, _ in ONE_CASE_A_SCRIPT])
def test_a_script_run_with_bad_flags_exits_2_before_it_starts_anything(script, flags, message, tmp_path):
    completed = subprocess.run([sys.executable, f"benchmarks/{script}", *flags, *out_dir(script, tmp_path)],
                               cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                               timeout=TORCH_CHILD_TIMEOUT_S)
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert message in completed.stderr
    assert "Traceback" not in completed.stderr
    assert list(tmp_path.iterdir()) == []  # no temporary folder, no output


def out_dir(script: str, tmp_path) -> list[str]:
    return [] if script == "dispatch.py" else ["--out-dir", str(tmp_path / "out")]
