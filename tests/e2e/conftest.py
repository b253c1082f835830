"""A whole local cluster started the way a user starts it: `python -m services.cluster up`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import openai
import pytest
import torch

from services.cluster.processes import ROOT, child_python_path
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams
from services.instance.engine.tokenizer import Tokenizer

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
                                    env={**os.environ, "PYTHONPATH": child_python_path()})
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
    """2 instances, a leader manager and a standby, on the tiny model. A killed child stays down
    (`--restart no`), so a killed leader's successor is the standby, not its restarted self."""
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster"), "--instances", "2",
                          "--managers", "2", "--kv-cache-mib", "16", "--restart", "no") as cluster:
        yield cluster


def model_name(cluster: dict) -> str:
    return os.path.basename(cluster["model"])


async def instances(admin) -> dict[str, manager_pb2.InstanceInfo]:
    reply = await admin.ListInstances(manager_pb2.ListInstancesRequest(), timeout=5)
    return {i.instance_id: i for i in reply.instances}


@pytest.fixture
async def admin(cluster):
    """AdminService stub of the module's `cluster` (each e2e module defines that fixture)."""
    channel = grpc.aio.insecure_channel(cluster["admin_address"])
    yield manager_pb2_grpc.AdminServiceStub(channel)
    await channel.close()


@pytest.fixture
async def client(cluster) -> AsyncIterator[openai.AsyncOpenAI]:
    # Closed on this test's loop: left to the GC, openai's __del__ closes it in a task on whatever loop runs then
    # (a later test's), which fails ('Event loop is closed') with no one to read the error.
    async with openai.AsyncOpenAI(base_url=f"{cluster['frontend_url']}/v1", api_key="unused", max_retries=0,
                                  timeout=240) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """reference(prompts, max_tokens[, grammar]) → greedy token ids of each prompt on one local engine, never
    migrated; max_tokens is one number for all prompts or one per prompt."""
    with local_reference(EngineSpec(tiny_model_dir, kv_name=f"ferry-e2e-ref-{os.getpid()}", num_blocks=2048)) as generate:
        yield generate


@contextlib.contextmanager
def local_reference(spec: EngineSpec) -> Iterator:
    torch.set_num_threads(1)  # the cluster's processes share the same few cores
    tokenizer = Tokenizer.from_dir(spec.model_dir)
    loaded = build_engine(spec)

    def generate(prompts: list[str], max_tokens: int | list[int], grammar: str = "") -> list[list[int]]:
        # All in one batch (the engine is batch-invariant on the CPU): 24 prompts of 500 tokens one after
        # another took 389 s on the loaded 2-core VM, past the test's timeout; in one batch, 31 s.
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        return loaded.engine.generate([tokenizer.encode(p) for p in prompts],
                                      [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, grammar=grammar)
                                       for m in budgets])

    try:
        yield generate
    finally:
        loaded.close()


async def wait_for(predicate, timeout_s: float, what: str):
    """Poll `await predicate()` every 0.2 s until it is truthy (returned) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(0.2)
