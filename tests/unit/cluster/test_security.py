"""ClusterSecurity: which flags each child gets, what cluster.json and the banner show."""

from __future__ import annotations

import pathlib
import shlex
import types

import pytest

from services.cluster.launcher import ClusterSpec, LocalCluster
from services.cluster.ready_banner import ready_banner
from services.cluster.security import ClusterSecurity

CA, CERT, KEY, TOKEN, CLUSTER_TOKEN = (pathlib.Path(f"/etc/ferry/{name}") for name in
                                       ("ca.pem", "cert.pem", "key.pem", "admin.token", "cluster.token"))
MTLS = ClusterSecurity(tls_ca=CA, tls_cert=CERT, tls_key=KEY, tls_client_ca=CA, admin_token_file=TOKEN)
TLS = ClusterSecurity(tls_ca=CA, tls_cert=CERT, tls_key=KEY)
TLS_FLAGS = ["--tls-ca", str(CA), "--tls-cert", str(CERT), "--tls-key", str(KEY)]


def test_off_gives_no_flags():
    off = ClusterSecurity()
    assert off.manager_args() == off.server_args() == off.client_args() == off.ctl_args() == []
    assert off.grpcurl_args() == ["-plaintext"]
    assert off.state() == {"tls": False, "tls_ca": "", "mtls": False, "tls_cert": "", "tls_key": "",
                           "admin_token_file": "", "cluster_token_file": ""}


def test_children_flags_under_mtls_with_a_token():
    assert MTLS.client_args() == TLS_FLAGS  # the frontend: no gRPC server of its own
    assert MTLS.server_args() == [*TLS_FLAGS, "--tls-client-ca", str(CA)]
    assert MTLS.manager_args() == [*TLS_FLAGS, "--tls-client-ca", str(CA), "--admin-token-file", str(TOKEN)]


def test_probe_presents_the_certificate():
    tls = MTLS.tls_config()
    assert (tls.is_client_tls, tls.is_server_tls, tls.ca_file) == (True, True, str(CA))


def test_tls_without_mtls_hands_out_no_client_certificate_to_tools():
    assert TLS.server_args() == TLS.manager_args() == TLS_FLAGS
    assert TLS.grpcurl_args() == ["-cacert", str(CA)]
    assert TLS.ctl_args() == ["--tls-ca", str(CA)]
    assert TLS.state()["tls_cert"] == ""


def banner(security: ClusterSecurity, tmp_path) -> str:
    spec = ClusterSpec(model_dir=pathlib.Path("/models/tiny"), roles=("both",), num_managers=1, engine="torch",
                       transfer_backend="grpc", http_port=8000, admin_port=50051, state_dir=tmp_path, cluster="ferry",
                       threads_per_instance=1, kv_cache_mib=16, log_format="console", security=security)
    cluster = LocalCluster(spec)
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    return ready_banner(cluster)


def test_banner_plaintext(tmp_path):
    text = banner(ClusterSecurity(), tmp_path)
    assert "grpcurl -plaintext 127.0.0.1:50051 ferry.v1.AdminService/ListInstances" in text
    assert "python -m services.ctl --admin 127.0.0.1:50051 instances" in text
    assert text.endswith("\nready")


def test_banner_shows_tls_and_token_flags_but_not_the_token(tmp_path):
    text = banner(MTLS, tmp_path)
    grpcurl = next(line.strip() for line in text.splitlines() if "ListInstances" in line)
    assert grpcurl == (f"grpcurl -cacert {CA} -cert {CERT} -key {KEY} -H \"authorization: Bearer $(cat {TOKEN})\" "
                       "127.0.0.1:50051 ferry.v1.AdminService/ListInstances")
    ctl = next(line.strip() for line in text.splitlines() if "services.ctl" in line)
    assert shlex.split(ctl) == ["python", "-m", "services.ctl", "--admin", "127.0.0.1:50051", "--tls-ca", str(CA),
                                "--tls-cert", str(CERT), "--tls-key", str(KEY), "--token-file", str(TOKEN),
                                "instances"]
    assert "mutual TLS" in text and "admin token required" in text


def test_the_cluster_token_file_goes_to_every_child_tls_or_not():
    plain = ClusterSecurity(cluster_token_file=CLUSTER_TOKEN)
    token_flags = ["--cluster-token-file", str(CLUSTER_TOKEN)]
    assert plain.client_args() == plain.server_args() == plain.manager_args() == token_flags
    assert plain.ctl_args() == []  # ferryctl calls the admin API alone, which the cluster token does not guard
    assert plain.state()["cluster_token_file"] == str(CLUSTER_TOKEN)
    mtls = ClusterSecurity(tls_ca=CA, tls_cert=CERT, tls_key=KEY, tls_client_ca=CA, cluster_token_file=CLUSTER_TOKEN)
    assert mtls.client_args() == [*TLS_FLAGS, *token_flags]
    assert mtls.server_args() == [*TLS_FLAGS, *token_flags, "--tls-client-ca", str(CA)]


def test_an_unusable_cluster_token_file_is_refused_naming_the_flag(tmp_path):
    spaced = tmp_path / "spaced.token"
    spaced.write_text("two words\n")
    for path, match in ((tmp_path / "missing", "--cluster-token-file"), (spaced, "printable ASCII")):
        with pytest.raises(ValueError, match=match):
            ClusterSecurity(cluster_token_file=path).check()


def test_banner_shows_an_instance_call_with_the_cluster_token_read_at_run_time(tmp_path):
    security = ClusterSecurity(cluster_token_file=CLUSTER_TOKEN)
    spec = ClusterSpec(model_dir=pathlib.Path("/models/tiny"), roles=("both",), num_managers=1, engine="torch",
                       transfer_backend="grpc", http_port=8000, admin_port=50051, state_dir=tmp_path, cluster="ferry",
                       threads_per_instance=1, kv_cache_mib=16, log_format="console", security=security)
    cluster = LocalCluster(spec)
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    cluster.processes = [types.SimpleNamespace(name="instance-0", address="127.0.0.1:40001")]
    text = ready_banner(cluster)
    line = next(line.strip() for line in text.splitlines() if "InstanceService" in line)
    assert line == (f"grpcurl -plaintext -H \"ferry-cluster-token: $(cat {CLUSTER_TOKEN})\" 127.0.0.1:40001 "
                    "ferry.v1.InstanceService/GetStatus")
    assert "cluster token required on internal services" in text
    assert "InstanceService" not in banner(ClusterSecurity(), tmp_path)


def test_a_generated_cluster_token_is_a_fresh_file_only_its_user_reads(tmp_path):
    generated = ClusterSecurity(generates_cluster_token=True).with_generated_cluster_token(tmp_path)
    path = tmp_path / "cluster.token"
    assert generated.cluster_token_file == path and not generated.generates_cluster_token
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    generated.check()  # a usable token file
    assert generated.client_args() == ["--cluster-token-file", str(path)]
    path.chmod(0o644)  # a later start writes a new one, 0600 again
    ClusterSecurity(generates_cluster_token=True).with_generated_cluster_token(tmp_path)
    assert path.read_text().strip() != token and path.stat().st_mode & 0o777 == 0o600
