"""The migration speed benchmark (issue 4) in its smallest form: it starts two real
transfer services and its reference processes, and prints the table the issue specifies."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.benchmark_run import ROOT, run_benchmark

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


def descendants(pid: int) -> set[int]:
    found = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found |= {int(child)} | descendants(int(child))
    return found


def is_running(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(240)
def test_sigterm_stops_the_services_and_unlinks_the_shared_memory(tmp_path):
    """`timeout` ends a run with SIGTERM: the run stops as after Ctrl-C. Before, the two transfer
    services (each in a session of its own) ran on for good and the KV segments stayed."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    bench = subprocess.Popen([sys.executable, "benchmarks/migration_speed.py", "--max-mb", "16", "--repeats", "1000",
                              "--out-dir", str(tmp_path)], cwd=ROOT, env={**os.environ, "TMPDIR": str(temporary)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    children, segments = [], set()
    try:
        while "migration_speed:" not in bench.stderr.read(64):  # the progress bar: every process is up
            assert bench.poll() is None, "the benchmark ended before it measured"
        children = descendants(bench.pid)
        segments = {line.split()[-1] for line in pathlib.Path(f"/proc/{bench.pid}/maps").read_text().splitlines()
                    if "/dev/shm/ferry-bench-" in line}
        assert len(segments) == 2 and len(children) >= 2
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 1 and "migration_speed: interrupted (services stopped" in stderr, stderr[-2000:]
        deadline = time.monotonic() + 10
        while (left := [pid for pid in children if is_running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
        assert [segment for segment in segments if pathlib.Path(segment).exists()] == []
    finally:  # what a failed run left: the benchmark, its services (sessions of their own), its segments
        bench.kill()
        for pid in children:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        for segment in segments:
            pathlib.Path(segment).unlink(missing_ok=True)
