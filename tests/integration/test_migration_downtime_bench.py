"""The migration downtime benchmark (issue 4) in a small form: two real instances on one
transfer service (`--backend auto`, as one host runs them), every mode at two lengths."""

from __future__ import annotations


import pytest

from tests.integration.benchmark_run import run_benchmark

COLUMNS = ["seq_len", "decode_step_ms", "live_downtime_ms", "stop_copy_downtime_ms", "recompute_downtime_ms",
           "live_minus_step_ms", "live_suspend_commit_ms", "stop_copy_suspend_commit_ms"]


@pytest.mark.timeout(240)
def test_prints_a_row_per_length_with_every_mode(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    lines = run_benchmark("migration_downtime.py", "--lengths", "64,256", "--repeats", "1",
                          "--backend", "auto", "--out-dir", str(tmp_path), timeout_s=220, tmp_dir=temporary)
    assert list(temporary.iterdir()) == []  # the tiny model and the logs went with the run (they stayed, every run)
    header = lines.index("\t".join(COLUMNS))
    rows = [line.split("\t") for line in lines[header + 1:header + 3]]
    assert [row[0] for row in rows] == ["64", "256"]
    for row in rows:
        assert all(float(value) > 0 for value in row[1:5]), row  # step, live, stop-and-copy, recompute
    assert (tmp_path / "migration_downtime.png").stat().st_size > 0
