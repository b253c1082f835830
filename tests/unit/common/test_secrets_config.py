"""Security knobs of every service: parsed from flags, env and files, checked, and never logged."""

from __future__ import annotations

import json

import pytest

from services.common.auth import bearer_metadata, read_token
from services.common.config import as_dict, parse_config
from services.common.tls import TlsConfig
from services.ctl.config import CtlConfig
from services.frontend.config import FrontendConfig
from services.instance.config import InstanceConfig
from services.manager.config import ManagerConfig
from services.transfer.config import TransferConfig

SECRET = "s3cr3t-value-never-logged"


@pytest.mark.parametrize(("cls", "service", "argv"), [
    (ManagerConfig, "manager", ["--admin-token", SECRET, "--etcd-user", "u", "--etcd-password", SECRET]),
    (InstanceConfig, "instance", ["--etcd-user", "u", "--etcd-password", SECRET]),
    (TransferConfig, "transfer", ["--etcd-user", "u", "--etcd-password", SECRET]),
    (FrontendConfig, "frontend", ["--api-key", SECRET, "--etcd-endpoints", "e:1", "--etcd-user", "u",
                                  "--etcd-password", SECRET]),
    (CtlConfig, "ctl", ["--token", SECRET]),
])
def test_logged_config_hides_secrets(cls, service, argv):
    config = parse_config(cls, service, argv, env={})
    logged = json.dumps(as_dict(config), default=str)
    assert SECRET not in logged
    assert SECRET not in repr(getattr(config, "etcd_access", ""))


def test_secret_from_env_and_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {SECRET}\n")
    assert parse_config(ManagerConfig, "manager", [], env={"FERRY_MANAGER_ADMIN_TOKEN": SECRET}).resolved_admin_token \
        == SECRET
    assert parse_config(ManagerConfig, "manager", ["--admin-token-file", str(token_file)],
                        env={}).resolved_admin_token == SECRET
    with pytest.raises(SystemExit):  # both
        parse_config(ManagerConfig, "manager", ["--admin-token", "a", "--admin-token-file", str(token_file)], env={})
    with pytest.raises(ValueError, match="--admin-token-file"):
        read_token("", str(tmp_path / "missing"), "admin-token")


def test_bearer_metadata():
    assert bearer_metadata("") == ()
    assert bearer_metadata("t") == (("authorization", "Bearer t"),)


def test_tls_config_checks(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("not checked here")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        TlsConfig(cert_file=str(pem)).check()
    with pytest.raises(ValueError, match="--tls-client-ca"):
        TlsConfig(client_ca_file=str(pem)).check()
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(ca_file=str(tmp_path / "missing.pem")).check()
    with pytest.raises(ValueError, match="--tls-ca .*: is a directory; give the PEM file itself"):
        TlsConfig(ca_file=str(tmp_path)).check()
    TlsConfig(cert_file=str(pem), key_file=str(pem), client_ca_file=str(pem), ca_file=str(pem)).check()
    with pytest.raises(SystemExit):
        parse_config(InstanceConfig, "instance", ["--tls-cert", str(pem)], env={})
    config = parse_config(TransferConfig, "transfer", ["--tls-cert", str(pem), "--tls-key", str(pem),
                                                       "--tls-client-ca", str(pem), "--tls-ca", str(pem)], env={})
    assert config.tls == TlsConfig(str(pem), str(pem), str(pem), str(pem))
