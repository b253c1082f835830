"""The health check's TLS settings: flags, else the service's own FERRY_<SERVICE>_TLS_* variables."""

from __future__ import annotations

import pytest

from services.ctl import healthcheck
from services.ctl.healthcheck import tls_from_environment

MANAGER_ENV = {"FERRY_MANAGER_TLS_CA": "/s/ca.pem", "FERRY_MANAGER_TLS_CERT": "/s/cert.pem",
               "FERRY_MANAGER_TLS_KEY": "/s/key.pem", "FERRY_MANAGER_TLS_CLIENT_CA": "/s/ca.pem",
               "FERRY_MANAGER_PORT": "50051", "PATH": "/usr/bin"}


def test_one_services_variables_are_the_defaults():
    assert tls_from_environment(MANAGER_ENV) == {"ca": "/s/ca.pem", "cert": "/s/cert.pem", "key": "/s/key.pem"}
    assert tls_from_environment({"FERRY_TRANSFER_TLS_CA": "", "HOME": "/root"}) == {}


def test_several_services_variables_are_ambiguous():
    with pytest.raises(ValueError, match="several services are set \\(MANAGER, TRANSFER\\)"):
        tls_from_environment({**MANAGER_ENV, "FERRY_TRANSFER_TLS_CA": "/t/ca.pem"})


@pytest.fixture
def checked(monkeypatch):
    """The TlsConfig the health check would dial with (no RPC is made)."""
    seen = []

    async def fake_status(address, service, timeout_s, tls=None):
        seen.append(tls)
        return "SERVING"
    monkeypatch.setattr(healthcheck, "grpc_status", fake_status)
    return seen


def test_flags_beat_the_variables(checked):
    assert healthcheck.main(["127.0.0.1:1", "--tls-ca", "/other/ca.pem"], env=MANAGER_ENV) == 0
    assert (checked[0].ca_file, checked[0].cert_file, checked[0].key_file) == ("/other/ca.pem", "/s/cert.pem",
                                                                               "/s/key.pem")


def test_no_variables_no_flags_is_plaintext(checked):
    assert healthcheck.main(["127.0.0.1:1"], env={}) == 0
    assert checked[0].ca_file == "" and checked[0].cert_file == ""


def test_ambiguous_environment_is_a_usage_error(checked, capsys):
    with pytest.raises(SystemExit) as exit_info:
        healthcheck.main(["127.0.0.1:1"], env={**MANAGER_ENV, "FERRY_INSTANCE_TLS_CA": "/i/ca.pem"})
    assert exit_info.value.code == 2 and "pass --tls-ca" in capsys.readouterr().err
