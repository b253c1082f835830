"""`benchmarks/serving.py --url` against a cluster it did not start: the requests name the model that
cluster serves (not the local --model folder's name), a --model whose token ids the cluster would
refuse stops the run before it starts, and a run where requests failed exits non-zero."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from tests.integration.running import running
from tests.integration.test_frontend import frontend_process

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVED_NAME = "bench-model"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def frontend(etcd, tiny_model_dir, tmp_path_factory):
    """One instance (256 blocks of 16 tokens) and a frontend serving the tiny model as `bench-model`."""
    cluster, port, logs = f"bench-{uuid.uuid4().hex[:8]}", free_port(), tmp_path_factory.mktemp("logs")
    instance = ServiceProcess(
        "instance-bench", "instance",
        ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", "bench-0", "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--num-blocks", "256", "--max-model-len", "1024"],
        f"127.0.0.1:{port}", logs)
    frontend = frontend_process("frontend-bench", etcd, tiny_model_dir, cluster, logs,
                                "--served-model-name", SERVED_NAME)
    with running(instance, frontend):
        yield frontend


def serving_bench(url: str, model_dir: pathlib.Path, out_dir: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/serving.py", "--url", url, "--model", str(model_dir), "--num-requests", "3",
         "--rate", "50", "--prompt-mean", "8", "--output-mean", "4", "--max-prompt", "32", "--max-output", "8",
         "--out-dir", str(out_dir), *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def test_requests_name_the_served_model_not_the_folder(frontend, tiny_model_dir, tmp_path):
    completed = serving_bench(frontend.address, tiny_model_dir, tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "serving.json").read_text())
    assert summary["num_errors"] == 0 and len(summary["ttft_ms"]) == 3, summary["requests"]
    assert (tmp_path / "serving.png").stat().st_size > 0


def test_a_model_folder_the_cluster_does_not_serve_stops_before_any_request(frontend, tiny_model_dir, tmp_path):
    bigger = tmp_path / "bigger-vocab"
    shutil.copytree(tiny_model_dir, bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 8}))
    completed = serving_bench(frontend.address, bigger, tmp_path / "out")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert f"serves '{SERVED_NAME}'" in completed.stderr and "pass --model" in completed.stderr, completed.stderr
    assert "outside the vocabulary" in completed.stderr, completed.stderr
    assert not (tmp_path / "out" / "serving.json").exists()


def test_failed_requests_make_the_run_exit_non_zero(frontend, tiny_model_dir, tmp_path):
    completed = serving_bench(frontend.address, tiny_model_dir, tmp_path, "--max-prompt", "2000", "--prompt-mean",
                              "1500", "--sigma", "0.01")  # past the 1024-token context: every request a 400
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "3 of 3 requests failed" in completed.stderr, completed.stderr
    assert json.loads((tmp_path / "serving.json").read_text())["num_errors"] == 3
