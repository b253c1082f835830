"""A whole local cluster started the way a user starts it: `python -m services.cluster up`."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from services.cluster.processes import ROOT
from services.common.etcd_launcher import free_port

_START_TIMEOUT_S = 120


@contextlib.contextmanager
def launched_cluster(model_dir: pathlib.Path, state_dir: pathlib.Path, *args: str) -> Iterator[dict]:
    """Run the launcher until the block ends; yields cluster.json (plus "state_dir")."""
    state_file = state_dir / "cluster.json"
    command = [sys.executable, "-m", "services.cluster", "up", "--model", str(model_dir), "--state-dir", str(state_dir),
               "--http-port", str(free_port()), "--admin-port", str(free_port()), "--threads-per-instance", "1", *args]
    log_path = state_dir.parent / f"{state_dir.name}-launcher.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not state_file.exists():
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield {**json.loads(state_file.read_text()), "state_dir": str(state_dir), "launcher_pid": launcher.pid}
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()


def pid_of(cluster: dict, name: str) -> int:
    return next(p["pid"] for p in cluster["processes"] if p["name"] == name)


def address_of(cluster: dict, name: str) -> str:
    return next(p["address"] for p in cluster["processes"] if p["name"] == name)


@pytest.fixture(scope="module")
def two_instance_cluster(tiny_model_dir, tmp_path_factory) -> Iterator[dict]:
    """2 instances, a leader manager and a standby, on the tiny model."""
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster"), "--instances", "2",
                          "--managers", "2", "--kv-cache-mib", "16") as cluster:
        yield cluster
