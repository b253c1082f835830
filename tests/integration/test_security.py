"""Security end to end: a small cluster (etcd, manager, transfer, instance on a tiny model,
frontend) with mutual TLS on every gRPC channel, a cluster token on every internal call, an
admin token on the manager and API keys on the frontend. Plaintext and unauthenticated
callers are refused; health and reflection stay open; no secret reaches a log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import uuid

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.cluster.processes import ROOT, ServiceProcess, TlsRejected, stop_all
from services.common.auth import bearer_metadata
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import (instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc,
                                          transfer_pb2, transfer_pb2_grpc)
from services.common.grpc_server import insecure_channel, secure_or_insecure_channel
from services.common.tls import TlsConfig
from tests.integration.certs import make_pki

pytestmark = pytest.mark.timeout(180)

ADMIN_TOKEN = f"admin-{uuid.uuid4().hex}"
API_KEY = f"sk-{uuid.uuid4().hex}"
CLUSTER_TOKEN = f"cluster-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls(pki) -> TlsConfig:
    """What every process (and the test's own clients) uses: mTLS with one CA, and the cluster token."""
    return TlsConfig(cert_file=str(pki.cert), key_file=str(pki.key), client_ca_file=str(pki.ca), ca_file=str(pki.ca),
                     cluster_token=CLUSTER_TOKEN)


@pytest.fixture(scope="module")
def cluster(etcd, tiny_model_dir, pki, tls, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    token_file = tmp_path_factory.mktemp("secrets") / "cluster.token"
    token_file.write_text(CLUSTER_TOKEN)
    token = {f"FERRY_{name}_CLUSTER_TOKEN_FILE": str(token_file) for name in ("MANAGER", "TRANSFER", "INSTANCE", "FRONTEND")}
    name = f"sec-{uuid.uuid4().hex[:8]}"
    tls_args = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)]
    server_tls = [*tls_args, "--tls-client-ca", str(pki.ca)]
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", name]
    ports = {n: free_port() for n in ("manager", "transfer", "instance", "frontend")}
    processes = {
        "manager": ServiceProcess("manager", "manager", ["--port", str(ports["manager"]), *common, *server_tls],
                                  f"127.0.0.1:{ports['manager']}", log_dir, tls=tls,
                                  env={"FERRY_MANAGER_ADMIN_TOKEN": ADMIN_TOKEN, **token}),
        "transfer": ServiceProcess("transfer", "transfer", ["--port", str(ports["transfer"]), "--transfer-id", "t0",
                                                            *common, *server_tls],
                                   f"127.0.0.1:{ports['transfer']}", log_dir, tls=tls, env=token),
        "instance": ServiceProcess(
            "instance", "instance",
            ["--model", str(tiny_model_dir), "--port", str(ports["instance"]), "--instance-id", "i0",
             "--num-threads", "1", "--num-blocks", "64", "--block-size", "4", "--max-model-len", "128",
             "--transfer-address", f"127.0.0.1:{ports['transfer']}", *common, *server_tls],
            f"127.0.0.1:{ports['instance']}", log_dir, tls=tls, env=token),
        "frontend": ServiceProcess(
            "frontend", "frontend",
            ["--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(ports["frontend"]),
             "--max-model-len", "128", *common, *tls_args],
            f"http://127.0.0.1:{ports['frontend']}", log_dir, env={"FERRY_FRONTEND_API_KEY": API_KEY, **token}),
    }
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            asyncio.run(process.wait_healthy(90))
        yield processes
    finally:
        stop_all(processes.values())


async def test_completion_through_tls_cluster(cluster, tls):
    """frontend → manager (Dispatch) and → instance (Generate), instance → manager (load reports) and
    → transfer (KV mapping): all over mutual TLS, all with the cluster token."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(base_url=cluster["frontend"].address, headers=headers) as http:
        body = {"prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        async with http.post("/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert len((await response.json())["choices"][0]["token_ids"]) == 4
    async with secure_or_insecure_channel(cluster["manager"].address, tls) as channel:
        admin = manager_pb2_grpc.AdminServiceStub(channel)
        for _ in range(50):
            reply = await admin.ListInstances(manager_pb2.ListInstancesRequest(), timeout=5,
                                              metadata=bearer_metadata(ADMIN_TOKEN))
            if reply.instances and reply.instances[0].num_total_blocks == 64:
                break
            await asyncio.sleep(0.1)
        assert [(i.instance_id, i.num_total_blocks) for i in reply.instances] == [("i0", 64)]
    async with secure_or_insecure_channel(cluster["transfer"].address, tls) as channel:
        status = await transfer_pb2_grpc.TransferServiceStub(channel).GetStatus(
            transfer_pb2.GetTransferStatusRequest(), timeout=5)
        assert "i0" in status.instance_ids


@pytest.mark.parametrize("service", ["manager", "instance", "transfer"])
async def test_plaintext_client_is_refused(cluster, service):
    async with insecure_channel(cluster[service].address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_tls_client_without_certificate_or_with_wrong_ca_is_refused(cluster, pki):
    address = cluster["instance"].address
    no_client_cert = TlsConfig(ca_file=str(pki.ca))
    wrong_ca = TlsConfig(cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(pki.other_ca))
    for tls in (no_client_cert, wrong_ca):
        async with secure_or_insecure_channel(address, tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(instance_pb2.GetStatusRequest(),
                                                                               timeout=3)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_tls_client_without_the_cluster_token_is_refused_by_internal_services(cluster, tls):
    without = dataclasses.replace(tls, cluster_token="")
    async with secure_or_insecure_channel(cluster["instance"].address, without) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await instance_pb2_grpc.InstanceServiceStub(channel).GetStatus(instance_pb2.GetStatusRequest(), timeout=3)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED and "--cluster-token-file" in caught.value.details()
    async with secure_or_insecure_channel(cluster["manager"].address, dataclasses.replace(tls, cluster_token="x")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await manager_pb2_grpc.ManagerServiceStub(channel).Dispatch(
                manager_pb2.DispatchRequest(request_id="r1", num_prompt_tokens=3), timeout=3)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_admin_api_requires_the_token(cluster, tls):
    """The admin token alone: operators need no cluster token."""
    async with secure_or_insecure_channel(cluster["manager"].address, dataclasses.replace(tls, cluster_token="")) as channel:
        admin = manager_pb2_grpc.AdminServiceStub(channel)
        request = manager_pb2.GetPolicyRequest()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await admin.GetPolicy(request, timeout=5)
        assert missing.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "--admin-token" in missing.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await admin.GetPolicy(request, timeout=5, metadata=bearer_metadata("not-the-token"))
        assert wrong.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await admin.GetPolicy(request, timeout=5, metadata=(("authorization", ADMIN_TOKEN),))
        assert malformed.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert (await admin.GetPolicy(request, timeout=5, metadata=bearer_metadata(ADMIN_TOKEN))).dispatch
        # health and reflection stay open
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = await _reflected_services(channel)
        assert "ferry.v1.AdminService" in services


def test_ferryctl_over_tls_with_token(cluster, pki):
    base = [sys.executable, "-m", "services.ctl", "--admin", cluster["manager"].address, "--tls-ca", str(pki.ca),
            "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([*base, "--token", ADMIN_TOKEN, "instances"], env=env, capture_output=True, text=True,
                        timeout=60, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert [row["instance_id"] for row in json.loads(ok.stdout)] == ["i0"]
    denied = subprocess.run([*base, "--token", "wrong", "instances"], env=env, capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert denied.returncode == 1 and "wrong token" in denied.stderr


def test_healthcheck_takes_tls_from_the_services_variables(cluster, pki):
    """What a compose health check runs inside the manager's container (mTLS on)."""
    def check(env: dict[str, str]) -> subprocess.CompletedProcess:
        plain = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        return subprocess.run([sys.executable, "-m", "services.ctl.healthcheck", cluster["manager"].address],
                              env={**plain, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
    manager_env = {"FERRY_MANAGER_TLS_CA": str(pki.ca), "FERRY_MANAGER_TLS_CERT": str(pki.cert),
                   "FERRY_MANAGER_TLS_KEY": str(pki.key), "FERRY_MANAGER_TLS_CLIENT_CA": str(pki.ca)}
    serving = check(manager_env)
    assert serving.returncode == 0 and serving.stdout.strip().endswith(": SERVING"), serving.stdout + serving.stderr
    assert check({}).returncode == 1  # plaintext against a TLS server


async def test_frontend_requires_an_api_key(cluster):
    async with aiohttp.ClientSession(base_url=cluster["frontend"].address) as http:
        async with http.get("/v1/models") as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "invalid_api_key"
        async with http.get("/v1/models", headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
        async with http.get("/health") as response:
            assert response.status == 200


def test_no_secret_in_logs(cluster):
    """Run last in this module: every process has logged its config and served calls."""
    for process in cluster.values():
        text = process.log_path.read_text(errors="replace")
        assert "config_resolved" in text
        for secret in (ADMIN_TOKEN, API_KEY, CLUSTER_TOKEN):
            assert secret not in text, f"{process.name} logged a secret"


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    async for reply in call:
        return {service.name for service in reply.list_services_response.service}
    return set()


@pytest.mark.parametrize("served_cert, probe_ca, hint", [
    ("elsewhere_cert", "ca", "subjectAltName"), ("cert", "other_ca", "--tls-ca")])
async def test_a_child_the_tls_check_rejects_fails_fast_with_what_to_fix(pki, tmp_path, served_cert, probe_ca, hint):
    """The launcher's health probe names a certificate that does not fit at once, not after its timeout."""
    port = free_port()
    probe_tls = TlsConfig(cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(getattr(pki, probe_ca)))
    process = ServiceProcess("transfer", "transfer", ["--port", str(port), "--tls-cert", str(getattr(pki, served_cert)),
                                                      "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)],
                             f"127.0.0.1:{port}", tmp_path, tls=probe_tls)
    process.start()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TlsRejected, match=hint):
            await process.wait_healthy(60)
        assert asyncio.get_running_loop().time() - started < 30
    finally:
        process.stop()
