"""An instance started with another model than the frontend's, in one cluster: a manager, a frontend and three
sim-engine instances, one on the frontend's tiny model, one on a model of another vocabulary and one on another
"fine-tune" of it (same config.json, weights of another seed), each started as an operator starts them
(`python -m services.<name>`) on the module's etcd, stopped by PID.

A black-box run on three "hosts" (2026-12-07) had a tiny 512-token instance join two SmolLM2 instances: the
load policy sent every request to it, the freest, and each got a 400 ("token id 3575 is outside the vocabulary
[0, 512)") while the right instances idled. The other instance here has 8 times the KV blocks, so the manager
would pick it for every request if the frontend did not exclude it.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import time
import uuid

import aiohttp
import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.errors import FailedPrecondition
from services.ctl.client import AdminClient
from services.instance.engine.model_fingerprint import model_fingerprint
from services.instance.models import build_tiny_model

pytestmark = pytest.mark.timeout(120)

OURS, OTHER, TUNED = "ours-0", "other-0", "tuned-0"


@pytest.fixture(scope="module")
def other_model_dir(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny model's folder with twice its vocabulary: a sim instance reads config.json alone, no weights."""
    folder = tmp_path_factory.mktemp("models") / "tiny-other-vocab"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 2 * config["vocab_size"]}))
    return folder


@pytest.fixture(scope="module")
def tuned_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Another fine-tune of the tiny model, as far as ferry can tell: its config, other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gqa-tied-tuned", "gqa-tied", seed=1)


@pytest.fixture(scope="module")
def mixed_cluster(etcd, tiny_model_dir, other_model_dir, tuned_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", f"mixed-{uuid.uuid4().hex[:8]}", "--lease-ttl-s", "3"]
    manager_port, http_port = free_port(), free_port()
    manager = ServiceProcess("manager-0", "manager", ["--port", str(manager_port), "--manager-id", "manager-0",
                                                      *common], f"127.0.0.1:{manager_port}", log_dir)
    instances = [_sim_instance(OURS, tiny_model_dir, 64, common, log_dir),
                 _sim_instance(OTHER, other_model_dir, 512, common, log_dir),
                 _sim_instance(TUNED, tuned_model_dir, 512, common, log_dir)]
    frontend = ServiceProcess("frontend-0", "frontend",
                              ["--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(http_port),
                               *common[:4]], f"http://127.0.0.1:{http_port}", log_dir)
    processes = [manager, *instances, frontend]
    try:
        for process in processes:
            process.start()
        for process in processes:
            asyncio.run(process.wait_healthy(90))
        asyncio.run(_wait_reported(manager.address))
        yield manager.address, frontend
    finally:
        stop_all(processes)


def _sim_instance(instance_id: str, model_dir: pathlib.Path, num_blocks: int, common: list[str],
                  log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(instance_id, "instance",
                          ["--model", str(model_dir), "--port", str(port), "--instance-id", instance_id,
                           "--num-threads", "1", "--num-blocks", str(num_blocks), "--block-size", "4",
                           "--max-model-len", "256", "--engine", "sim", "--sim-step-ms", "1", *common],
                          f"127.0.0.1:{port}", log_dir)


async def _wait_reported(admin_address: str) -> None:
    """Until the leader holds a load report of both (else dispatch passes an unreported one over)."""
    deadline = time.monotonic() + 60
    async with AdminClient(admin_address, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if {r.instance_id for r in await client.list_instances() if r.report_age_s >= 0} == {OURS, OTHER, TUNED}:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError("the instances never reported to the manager")


async def test_requests_go_only_to_the_instance_of_the_frontends_model(mixed_cluster):
    admin_address, frontend = mixed_cluster
    body = {"model": "tiny-gqa-tied", "prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for _ in range(4):
            async with http.post(f"{frontend.address}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
    assert await _served_when_four(admin_address) == {OURS: 4, OTHER: 0, TUNED: 0}
    assert "instance_model_mismatch" in frontend.log_tail(200)


async def test_no_request_moves_to_another_fine_tune(mixed_cluster, tiny_model_dir, tuned_model_dir):
    """Same config, other weights: the records' fingerprints (ListInstances shows them) differ, so an admin
    Migrate between the two is refused before anything moves (balancing and PD hand-offs pair by the same check:
    tests/unit/manager)."""
    admin_address, _ = mixed_cluster
    async with AdminClient(admin_address, timeout_s=5.0) as client:
        shown = {r.instance_id: r.model_fingerprint for r in await client.list_instances()}
        assert shown[OURS] == model_fingerprint(tiny_model_dir) != model_fingerprint(tuned_model_dir) == shown[TUNED]
        with pytest.raises(FailedPrecondition, match=f"destination {TUNED} serves another model than {OURS}"):
            await client.migrate(src_instance_id=OURS, dst_instance_id=TUNED)


async def _served_when_four(admin_address: str) -> dict[str, int]:
    """Requests served by each instance once load reports count all four (or after 10 s)."""
    deadline = time.monotonic() + 10
    async with AdminClient(admin_address, timeout_s=5.0) as client:
        while True:
            served = {r.instance_id: r.num_requests_served for r in await client.list_instances()}
            if sum(served.values()) >= 4 or time.monotonic() > deadline:
                return served
            await asyncio.sleep(0.2)
