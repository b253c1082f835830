"""The policy benchmark in its smallest form: a real sim cluster through the launcher, each of
two seeds' workloads under two policies, and the tables it prints (one row per seed and policy,
ratios to the first policy of the same seed, no errors, migrations only where migration was on;
then one row per policy over the seeds)."""

from __future__ import annotations

import json

import pytest

from tests.integration.benchmark_run import run_benchmark

HEADER = ("seed\tpolicy\tttft_p50(ms)\tttft_p99(ms)\tdecode_p50(ms)\tdecode_p99(ms)\tmigrations\tpreemptions"
          "\terrors\tprefix_hit\tp99_ttft_vs_first\tp99_decode_vs_first")
SUMMARY = ("policy\tseeds\tttft_p50(ms)\tttft_p99(ms)\tdecode_p50(ms)\tdecode_p99(ms)\tmigrations\tpreemptions"
           "\terrors\tp99_ttft_vs_first\trange\tp99_decode_vs_first\trange")


@pytest.mark.timeout(400)
def test_prints_one_row_per_seed_and_policy(tmp_path, tiny_model_dir):
    lines = run_benchmark("policy_sim.py", "--model", str(tiny_model_dir), "--instances", "2",
                          "--policies", "round_robin:off,prefix:on", "--num-prefixes", "2", "--prefix-len", "48",
                          "--num-requests", "12", "--rate", "8", "--burstiness", "0.5", "--seeds", "0,1",
                          "--sim-step-ms", "10", "--output-mean", "16", "--max-output", "64", "--max-prompt", "256",  # prefix + prompt within the tiny model's 1024
                          "--out-dir", str(tmp_path),
                          timeout_s=380)
    rows = lines[lines.index(HEADER) + 1:lines.index(HEADER) + 5]
    cells = [row.split("\t") for row in rows]
    assert [(c[0], c[1]) for c in cells] == [("0", "round_robin:off"), ("0", "prefix:on"),
                                             ("1", "round_robin:off"), ("1", "prefix:on")]
    first = [c for c in cells if c[1] == "round_robin:off"]
    assert all(c[8] == "0" for c in cells) and all(c[6] == "0" and c[10] == c[11] == "1.00" for c in first), rows
    assert all(int(c[7]) >= 0 for c in cells)
    assert all(0.0 <= float(c[9]) <= 1.0 for c in cells) and all(float(c[9]) > 0 for c in cells if c[1] == "prefix:on")
    assert all(float(value) > 0 for c in cells for value in c[2:6])
    summary = [row.split("\t") for row in lines[lines.index(SUMMARY) + 1:lines.index(SUMMARY) + 3]]
    assert [(c[0], c[1], c[8]) for c in summary] == [("round_robin:off", "2", "0"), ("prefix:on", "2", "0")]
    assert summary[0][9:] == ["1.00", "1.00-1.00", "1.00", "1.00-1.00"]
    runs = json.loads((tmp_path / "policy_sim.json").read_text())["runs"]
    assert [(run["seed"], len(run["ttft_ms"])) for run in runs] == [(0, 12), (0, 12), (1, 12), (1, 12)]
    assert (tmp_path / "policy_sim.png").stat().st_size > 0
