"""The policy benchmark in its smallest form: a real sim cluster through the launcher, the
same workload under two policies, and the table it prints (one row per policy, no errors,
migrations only where migration was on)."""

from __future__ import annotations

import json

import pytest

from tests.integration.benchmark_run import run_benchmark

HEADER = ("policy\tttft_p50(ms)\tttft_p99(ms)\tdecode_p50(ms)\tdecode_p99(ms)\tmigrations\terrors\tprefix_hit"
          "\tp99_ttft_vs_first")


@pytest.mark.timeout(300)
def test_prints_one_row_per_policy(tmp_path, tiny_model_dir):
    lines = run_benchmark("policy_sim.py", "--model", str(tiny_model_dir), "--instances", "2",
                          "--policies", "round_robin:off,prefix:on", "--num-prefixes", "2", "--prefix-len", "48", "--num-requests", "12", "--rate", "8", "--sim-step-ms", "10",
                          "--output-mean", "16", "--max-output", "64", "--out-dir", str(tmp_path), timeout_s=280)
    rows = lines[lines.index(HEADER) + 1:lines.index(HEADER) + 3]
    cells = [row.split("\t") for row in rows]
    assert [c[0] for c in cells] == ["round_robin:off", "prefix:on"]
    assert all(c[6] == "0" for c in cells) and cells[0][5] == "0" and cells[0][8] == "1.00"
    assert all(0.0 <= float(c[7]) <= 1.0 for c in cells) and float(cells[1][7]) > 0  # shared prefixes hit
    assert all(float(value) > 0 for c in cells for value in c[1:5])
    runs = json.loads((tmp_path / "policy_sim.json").read_text())["runs"]
    assert [len(run["ttft_ms"]) for run in runs] == [12, 12]
    assert (tmp_path / "policy_sim.png").stat().st_size > 0
