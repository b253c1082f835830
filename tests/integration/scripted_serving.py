"""A scripted model (tests/scripted_model.py) served by a real instance and frontend process
on a real etcd, and an `openai` client of it: what the tool-call tests run against."""

from __future__ import annotations

import contextlib
import pathlib
import uuid
from collections.abc import AsyncIterator, Iterator

import openai

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from tests.integration.running import running
from tests.integration.test_frontend import frontend_process


@contextlib.contextmanager
def serving(name: str, etcd, model_dir: pathlib.Path, logs: pathlib.Path) -> Iterator[ServiceProcess]:
    """One instance and a frontend serving `model_dir` in a cluster of their own; yields the frontend."""
    cluster, port = f"{name}-{uuid.uuid4().hex[:8]}", free_port()
    instance = ServiceProcess(
        f"instance-{name}", "instance",
        ["--model", str(model_dir), "--port", str(port), "--instance-id", f"{name}-0", "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--lease-ttl-s", "3", "--num-blocks", "256",
         "--block-size", "16", "--max-model-len", "1024"],
        f"127.0.0.1:{port}", logs)
    frontend = frontend_process(f"frontend-{name}", etcd, model_dir, cluster, logs, "--max-model-len", "1024")
    with running(instance, frontend):
        yield frontend


@contextlib.asynccontextmanager
async def openai_client(frontend: ServiceProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{frontend.address}/v1", api_key="none", max_retries=0,
                                  timeout=60) as client:
        yield client
