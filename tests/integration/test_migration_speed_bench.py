"""The migration speed benchmark (issue 4) in its smallest form: it starts two real
transfer services and its reference processes, and prints the table the issue specifies."""

from __future__ import annotations


import pytest

from tests.integration.benchmark_run import run_benchmark

ROWS = ("grpc_speed(GB/s)", "gloo_speed(GB/s)", "shm_speed(GB/s)", "grpc_contiguous_speed(GB/s)",
        "gloo_contiguous_speed(GB/s)", "shm_contiguous_speed(GB/s)", "tcp_speed(GB/s)", "grpc_raw_speed(GB/s)",
        "gloo_raw_speed(GB/s)", "memcpy_speed(GB/s)")


@pytest.mark.timeout(240)
def test_prints_every_backend_and_reference(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    lines = run_benchmark("migration_speed.py", "--max-mb", "16", "--repeats", "1", "--out-dir", str(tmp_path),
                          timeout_s=220, tmp_dir=temporary)
    assert list(temporary.iterdir()) == []  # the services' log folder went with the run (it stayed, every run)
    assert lines[0] == "migration_size\t8.00 MB\t16.00 MB"
    table = {line.split("\t")[0]: line.split("\t")[1:] for line in lines[1:] if "\t" in line}
    assert tuple(table) == ROWS
    for label, speeds in table.items():
        assert len(speeds) == 2 and all(float(speed) > 0 for speed in speeds), (label, speeds)
    assert (tmp_path / "migration_speed.png").stat().st_size > 0
    assert (tmp_path / "results.tsv").read_text().splitlines() == lines[:len(ROWS) + 1]
