import pytest

from services.common.errors import Unavailable
from services.ctl.__main__ import _fail, build_parser, resolve_config


def config_of(argv, monkeypatch, env=None):
    for name in ("FERRY_CTL_ADMIN", "FERRY_CTL_TOKEN", "FERRY_CTL_JSON", "FERRY_CTL_TIMEOUT_S", "FERRY_CTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    return args, resolve_config(args)


def test_defaults(monkeypatch):
    args, config = config_of(["instances"], monkeypatch)
    assert (args.command, config.admin, config.json, config.token) == ("instances", "127.0.0.1:50051", False, "")


def test_global_flags_before_or_after_the_command(monkeypatch):
    _, before = config_of(["--json", "--admin", "h:1", "status"], monkeypatch)
    _, after = config_of(["status", "--json", "--admin", "h:1"], monkeypatch)
    assert before == after and before.json and before.admin == "h:1"


def test_environment_then_flags(monkeypatch):
    _, config = config_of(["status"], monkeypatch, {"FERRY_CTL_ADMIN": "env:2", "FERRY_CTL_JSON": "true"})
    assert (config.admin, config.json) == ("env:2", True)
    _, config = config_of(["--admin", "cli:3", "status"], monkeypatch, {"FERRY_CTL_ADMIN": "env:2"})
    assert config.admin == "cli:3"


def test_subcommand_arguments(monkeypatch):
    args, _ = config_of(["policy", "set", "round_robin"], monkeypatch)
    assert (args.action, args.dispatch, args.set) == ("set", "round_robin", None)
    args, _ = config_of(["policy", "set", "--set", "migration_enabled=true", "--set", "migration_threshold=8"],
                        monkeypatch)
    assert (args.dispatch, args.set) == (None, ["migration_enabled=true", "migration_threshold=8"])
    args, _ = config_of(["top", "--iterations", "3", "--interval", "0.5"], monkeypatch)
    assert (args.iterations, args.interval) == (3, 0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["role", "i-0", "leader"])


def test_policyparse_assignments_parse_json_values():
    from services.ctl.commands import parse_assignment

    assert parse_assignment("migration_enabled=true") == ("migration_enabled", True)
    assert parse_assignment("migration_threshold=8.5") == ("migration_threshold", 8.5)
    assert parse_assignment("migration_selection=MIGRATION_SELECTION_SHORTEST") == (
        "migration_selection", "MIGRATION_SELECTION_SHORTEST")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_assignment("migration_enabled")
    # `status` shows dispatch_policy and the manager's flag is --dispatch-policy: the policy field is dispatch
    assert parse_assignment("dispatch_policy=prefix") == ("dispatch", "prefix")


def test_only_a_manager_that_could_not_be_reached_gets_the_admin_hint(capsys):
    """An UNAVAILABLE the manager answered with is about something behind it (a transfer service
    down during a migrate): pointing at --admin then sends the operator the wrong way."""
    config = resolve_config(build_parser().parse_args(["--admin", "10.0.0.9:50051", "instances"]))
    assert _fail(config, Unavailable("failed to connect to all addresses"), 1, is_manager_reached=False) == 1
    assert "manager at --admin 10.0.0.9:50051; set --admin or FERRY_CTL_ADMIN" in capsys.readouterr().err
    _fail(config, Unavailable("transfer service at 127.0.0.1:26263: connection refused"), 1, is_manager_reached=True)
    err = capsys.readouterr().err
    assert "26263" in err and "--admin" not in err


def test_an_unreachable_manager_gets_the_tls_setting_that_may_be_missing(capsys, tmp_path):
    """A manager under mutual TLS refuses a handshake without a client certificate ("Socket closed"):
    ferryctl with --tls-ca alone only said to try another manager (black-box run of a TLS fleet)."""
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("-")
    ca = ["--tls-ca", str(tmp_path / "ca.pem")]
    cert = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    hints = {}
    for name, argv in (("plain", []), ("ca", ca), ("mtls", ca + cert)):
        config = resolve_config(build_parser().parse_args([*argv, "instances"]))
        _fail(config, Unavailable("failed to connect to all addresses; Socket closed"), 1, is_manager_reached=False)
        hints[name] = capsys.readouterr().err
    assert "pass --tls-ca" in hints["plain"]
    assert "--tls-ca" not in hints["ca"] and "pass --tls-cert and --tls-key" in hints["ca"]
    assert "signed by the CA of its --tls-client-ca" in hints["mtls"]
    _fail(config, Unavailable("failed to connect to all addresses; Connection refused"), 1, is_manager_reached=False)
    assert "tls" not in capsys.readouterr().err  # nothing listens there: no TLS setting would help


@pytest.mark.parametrize("argv", [["top", "--iterations", "-1"], ["top", "--interval", "nan"],
                                  ["top", "--interval", "-1"], ["top", "--interval", "inf"],
                                  ["top", "--interval-s", "soon"], ["top", "--iterations", "two"]])
def test_top_refuses_counts_and_intervals_it_cannot_use(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "must be" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_timeout_must_be_a_positive_finite_number(value):
    with pytest.raises(SystemExit):
        resolve_config(build_parser().parse_args(["--timeout-s", value, "instances"]))


def test_top_interval_is_named_in_seconds_like_every_other_duration_flag():
    # --interval-s as scale_hooks and the services spell durations; --interval still works
    assert build_parser().parse_args(["top", "--interval-s", "0.5"]).interval == 0.5
    assert build_parser().parse_args(["top", "--interval", "2"]).interval == 2.0


def test_global_help_shows_empty_defaults_as_empty_and_names_the_config_env():
    text = " ".join(build_parser().format_help().split())
    assert "(default: )" not in text and "[env FERRY_CTL_TOKEN] (default: empty)" in text
    assert "FERRY_CTL_CONFIG" in text


def test_a_subcommand_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["role", "instance-1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "ferryctl role: error: the following arguments are required: role\n"
