"""etcd TLS and auth settings reach the etcd client: flags and env → config → EtcdAccess →
Etcd3Client; and against a real etcd with authentication enabled, the configured user
gets in, a wrong password or no credentials do not."""

from __future__ import annotations

import time
import uuid

import pytest
from etcd3aio import Etcd3Client

from services.cluster import scale_hooks
from services.common.errors import FailedPrecondition
from services.common.etcd_client import ETCD_ERRORS, EtcdAccess, connect_etcd
from services.common.etcd_launcher import LocalEtcd
from services.common.registry import Registry
from services.instance.config import InstanceConfig
from services.manager.config import ManagerConfig
from services.common.config import parse_config
from tests.integration.certs import make_pki

pytestmark = pytest.mark.timeout(120)

ROOT_PASSWORD = f"pw-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def auth_etcd():
    """A dedicated etcd (auth on for the rest of its life) with user root."""
    with LocalEtcd() as etcd:
        yield etcd


async def _enable_auth(endpoint: str) -> None:
    client = Etcd3Client([endpoint])
    await client.connect()
    try:
        await client.auth.user_add("root", ROOT_PASSWORD, timeout=5)
        await client.auth.role_add("root", timeout=5)
        await client.auth.user_grant_role("root", "root", timeout=5)
        await client.auth.auth_enable(timeout=5)
    finally:
        await client.close()


def test_tls_and_auth_options_reach_the_client(tmp_path, monkeypatch):
    pki = make_pki(tmp_path / "pki")
    password_file = tmp_path / "etcd-password"
    password_file.write_text(ROOT_PASSWORD + "\n")
    env = {"FERRY_INSTANCE_ETCD_USER": "ferry", "FERRY_INSTANCE_ETCD_PASSWORD_FILE": str(password_file)}
    config = parse_config(InstanceConfig, "instance", ["--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.cert),
                                                       "--etcd-key", str(pki.key), "--etcd-server-name", "etcd.local"],
                          env=env)
    access = config.etcd_access
    assert (access.user, access.password, access.server_name) == ("ferry", ROOT_PASSWORD, "etcd.local")
    assert ROOT_PASSWORD not in repr(access)
    kwargs = access.client_kwargs()
    assert kwargs["ca_cert"] == pki.ca.read_bytes() and kwargs["cert_chain"] == pki.cert.read_bytes()
    assert kwargs["cert_key"] == pki.key.read_bytes() and kwargs["tls_server_name"] == "etcd.local"
    client = Etcd3Client(["127.0.0.1:1"], **kwargs)
    assert client._conn_args["ca_cert"] == pki.ca.read_bytes()


def test_scale_hooks_take_the_same_etcd_options(tmp_path):
    pki = make_pki(tmp_path / "pki")
    password_file = tmp_path / "etcd-password"
    password_file.write_text(ROOT_PASSWORD + "\n")
    required = ["--etcd-endpoints", "127.0.0.1:2379", "--add-command", "true", "--stop-command", "true"]
    access = scale_hooks.etcd_access(scale_hooks.parse_args(required + [
        "--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.cert), "--etcd-key", str(pki.key),
        "--etcd-user", "ferry", "--etcd-password-file", str(password_file)]))
    assert (access.ca_file, access.user, access.password) == (str(pki.ca), "ferry", ROOT_PASSWORD)
    with pytest.raises(SystemExit, match="--etcd-password needs --etcd-user"):
        scale_hooks.main(required + ["--etcd-password", "x"])


def test_half_set_etcd_options_are_refused(tmp_path):
    pki = make_pki(tmp_path / "pki")
    with pytest.raises(SystemExit):
        parse_config(ManagerConfig, "manager", ["--etcd-cert", str(pki.cert)], env={})  # no key, no CA
    with pytest.raises(SystemExit):
        parse_config(ManagerConfig, "manager", ["--etcd-password", "x"], env={})  # no user
    with pytest.raises(ValueError, match="--etcd-key"):
        EtcdAccess(ca_file=str(pki.ca), cert_file=str(pki.cert)).check()


async def test_authenticated_client_against_etcd_with_auth(auth_etcd):
    await _enable_auth(auth_etcd.endpoint)
    client = await connect_etcd([auth_etcd.endpoint], EtcdAccess(user="root", password=ROOT_PASSWORD))
    try:
        await client.kv.put("/ferry/auth-test/key", "v", timeout=5)
        assert (await client.kv.get("/ferry/auth-test/key", timeout=5)).kvs[0].value == b"v"
    finally:
        await client.close()
    with pytest.raises(ETCD_ERRORS):
        await connect_etcd([auth_etcd.endpoint], EtcdAccess(user="root", password="wrong"))
    anonymous = await connect_etcd([auth_etcd.endpoint])
    try:
        with pytest.raises(ETCD_ERRORS):
            await anonymous.kv.put("/ferry/auth-test/key", "w", timeout=5)
    finally:
        await anonymous.close()
    async with Registry([auth_etcd.endpoint], "auth-test", ttl_s=3,
                        access=EtcdAccess(user="root", password=ROOT_PASSWORD)) as registry:
        await registry.wait_until_reachable(30)
        await registry.register("instances", "i0", {"address": "127.0.0.1:1"})
        assert registry.is_registered
    for access in (EtcdAccess(user="root", password="wrong"), None):  # refused: the startup wait does not wait
        refused = Registry([auth_etcd.endpoint], "auth-test", ttl_s=3, access=access)
        started = time.monotonic()
        with pytest.raises(FailedPrecondition, match="refused us"):
            await refused.wait_until_reachable(30)
        assert time.monotonic() - started < 10
        await refused.close()
