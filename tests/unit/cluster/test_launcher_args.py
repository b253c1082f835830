"""`python -m services.cluster up` security flags: all three TLS files or none, mTLS only on
top of TLS, files that exist, absolute paths for the children."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from services.cluster.__main__ import build_spec, parse_args
from services.cluster.launcher import LocalCluster
from services.cluster.security import ClusterSecurity
from services.common.etcd_launcher import EtcdStartFailed, LocalEtcd


@pytest.fixture
def files(tmp_path) -> dict[str, pathlib.Path]:
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "client-ca")}
    paths["token"] = tmp_path / "admin.token"
    for name, path in paths.items():
        path.write_text("s3cret-token\n" if name == "token" else "PEM")
    return paths


def tls_flags(files) -> list[str]:
    return ["--tls-ca", str(files["ca"]), "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])]


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(["up", *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_security_is_off_by_default():
    args = parse_args(["up"])
    assert args.security == ClusterSecurity()
    assert not (args.security.is_tls or args.security.is_mtls or args.security.has_admin_token)


def test_all_three_tls_files_turn_on_tls(files):
    security = parse_args(["up", *tls_flags(files)]).security
    assert (security.is_tls, security.is_mtls, security.has_admin_token) == (True, False, False)
    assert (security.tls_ca, security.tls_cert, security.tls_key) == (files["ca"], files["cert"], files["key"])


def test_client_ca_and_token_file(files):
    security = parse_args(["up", *tls_flags(files), "--tls-client-ca", str(files["client-ca"]),
                           "--admin-token-file", str(files["token"])]).security
    assert (security.is_mtls, security.tls_client_ca, security.admin_token_file) == (True, files["client-ca"],
                                                                                     files["token"])


def test_relative_paths_become_absolute(files, monkeypatch):
    """The children run from the repository root, not from the caller's directory."""
    monkeypatch.chdir(files["ca"].parent)
    security = parse_args(["up", "--tls-ca", "ca.pem", "--tls-cert", "cert.pem", "--tls-key", "key.pem",
                           "--admin-token-file", "admin.token"]).security
    assert security.tls_ca == files["ca"] and security.tls_ca.is_absolute()
    assert security.admin_token_file == files["token"]


@pytest.mark.parametrize("given, missing", [
    (["ca"], "--tls-cert and --tls-key"),
    (["cert"], "--tls-ca and --tls-key"),
    (["key"], "--tls-ca and --tls-cert"),
    (["ca", "cert"], "--tls-key"),
    (["cert", "key"], "--tls-ca"),
    (["ca", "key"], "--tls-cert"),
])
def test_tls_files_go_together(files, capsys, given, missing):
    argv = [arg for name in given for arg in (f"--tls-{name}", str(files[name]))]
    error = usage_error(argv, capsys)
    assert "--tls-ca, --tls-cert and --tls-key go together" in error and f"missing {missing}\n" in error


def test_client_ca_needs_tls(files, capsys):
    error = usage_error(["--tls-client-ca", str(files["client-ca"])], capsys)
    assert "--tls-client-ca (mTLS) needs TLS" in error


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-cert", "--tls-key", "--tls-client-ca"])
def test_a_missing_tls_file_is_named(files, capsys, tmp_path, flag):
    absent = tmp_path / "absent.pem"
    argv = [*tls_flags(files), "--tls-client-ca", str(files["client-ca"])]
    argv[argv.index(flag) + 1] = str(absent)
    assert f"{flag} {absent}: no such file" in usage_error(argv, capsys)


def test_a_missing_or_empty_token_file_is_named(files, capsys, tmp_path):
    absent = tmp_path / "absent.token"
    assert f"--admin-token-file {absent}:" in usage_error(["--admin-token-file", str(absent)], capsys)
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    assert f"--admin-token-file {empty} is empty" in usage_error(["--admin-token-file", str(empty)], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--http-port", "70000"], "--http-port must be a port number 1..65535, got 70000"),
    (["--admin-port", "0"], "--admin-port must be a port number 1..65535, got 0"),
    (["--http-port", "18220", "--admin-port", "18220"], "--http-port and --admin-port must differ"),
    (["--kv-cache-mib", "0"], "--kv-cache-mib must be positive, got 0"),
    (["--threads-per-instance", "-1"], "--threads-per-instance must be >= 0"),
    (["--transfer-threads", "-1"], "--transfer-threads must be >= 0"),
])
def test_unusable_ports_caches_and_threads_are_usage_errors(capsys, argv, words):
    assert words in usage_error(argv, capsys)


def test_engine_vllm_is_refused_with_the_reason(capsys):
    error = usage_error(["--engine", "vllm"], capsys)
    assert "--engine vllm is not built yet" in error and "--engine torch" in error


def test_restart_defaults_to_on_failure_and_no_turns_it_off(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    model = ["--model", str(tmp_path)]
    assert build_spec(parse_args(["up", *model])).restart.on_failure
    assert not build_spec(parse_args(["up", *model, "--restart", "no"])).restart.on_failure


def test_a_model_folder_without_config_json_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        build_spec(parse_args(["up", "--model", str(tmp_path)]))
    assert exited.value.code == 2 and "no config.json there" in capsys.readouterr().err


def test_a_state_dir_that_is_a_file_fails_with_one_line_not_a_traceback(tmp_path, tiny_model_dir):
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("")
    result = subprocess.run([sys.executable, "-m", "services.cluster", "up", "--model", str(tiny_model_dir),
                             "--engine", "sim", "--state-dir", str(not_a_dir)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"cluster failed to start: --state-dir {not_a_dir}: cannot use it as a directory "
                                    "(File exists)"), result.stderr
    assert "Traceback" not in result.stderr


def test_an_etcd_that_cannot_start_on_its_data_dir_says_where_it_is(tmp_path):
    data_dir = tmp_path / "etcd"
    (data_dir / "member" / "snap").mkdir(parents=True)
    (data_dir / "member" / "snap" / "db").write_bytes(b"not a bolt database" * 100)
    with pytest.raises(EtcdStartFailed, match=f"if its data dir {data_dir} was damaged"):
        LocalEtcd(data_dir=data_dir, log_dir=tmp_path).start()


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
                                       ("::", "http://127.0.0.1:8000"), ("::1", "http://[::1]:8000"),
                                       ("10.0.0.5", "http://10.0.0.5:8000")])
def test_the_frontend_url_the_launcher_probes_reaches_the_http_host(host, url, tiny_model_dir):
    spec = build_spec(parse_args(["up", "--http-host", host, "--http-port", "8000", "--engine", "sim",
                                  "--model", str(tiny_model_dir)]))
    assert LocalCluster(spec).frontend_url == url


def test_a_cluster_token_file_without_tls(files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(files["token"].parent)
    security = parse_args(["up", "--cluster-token-file", "admin.token"]).security
    assert security.cluster_token_file == files["token"] and security.has_cluster_token and not security.is_tls
    absent = tmp_path / "absent.token"
    assert f"--cluster-token-file {absent}:" in usage_error(["--cluster-token-file", str(absent)], capsys)


def test_cluster_token_file_auto_is_generated_at_start_not_read_now(files, monkeypatch):
    monkeypatch.chdir(files["token"].parent)
    security = parse_args(["up", "--cluster-token-file", "auto"]).security
    assert security.generates_cluster_token and security.cluster_token_file is None
    (files["token"].parent / "auto").write_text("a-file-called-auto\n")
    named = parse_args(["up", "--cluster-token-file", "./auto"]).security
    assert not named.generates_cluster_token and named.cluster_token_file == files["token"].parent / "auto"


def test_the_cluster_name_is_checked_before_anything_starts(capsys):
    # before, `up --cluster eu/prod` started etcd and children that used it as a nested etcd prefix
    assert "--cluster 'eu/prod': not an id" in usage_error(["--cluster", "eu/prod"], capsys)
    assert "--cluster is empty" in usage_error(["--cluster", ""], capsys)
