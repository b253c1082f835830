"""services.common.config: precedence, parsing of each field type, --help text."""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re
import time

import pytest
import torch

from services.common.config import (as_dict, build_parser, check_non_negative, check_positive, convert, env_name, knob,
                                   parse_config)
from services.common.logging import LogFormat, LogLevel
from services.frontend.config import FrontendConfig
from services.instance.config import BackendChoice, InstanceConfig
from services.manager.config import ManagerConfig
from services.transfer.config import TransferConfig
from services.transfer.domain import TransferBackend

pytestmark = pytest.mark.timeout(10)


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """Demo service."""

    port: int = knob(50051, "gRPC port (50% of the time 0)")
    ratio: float = knob(0.5, "a fraction")
    name: str = knob("demo", "display name")
    is_verbose: bool = knob(False, "log more")
    mode: Mode = knob(Mode.FAST, "how to run")
    peers: list[str] = knob([], "peer addresses, comma separated")
    sizes: tuple[int, ...] = knob((1, 2), "bucket sizes")
    model_dir: pathlib.Path | None = knob(None, "model folder")
    limit: int | None = knob(8, "optional cap; none for no cap")
    api_key: str = knob("", "secret key")

    def __post_init__(self) -> None:
        if self.ratio > 1:
            raise ValueError(f"--ratio must be at most 1, got {self.ratio}")


def parse(argv=(), env=None) -> DemoConfig:
    return parse_config(DemoConfig, "demo", list(argv), env or {})


def test_defaults() -> None:
    config = parse()
    assert config == DemoConfig()
    assert config.peers == [] and config.peers is not DemoConfig().peers


def test_cli_beats_env_beats_file_beats_default(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "demo.yaml"
    file.write_text("port: 1\nname: from-file\nratio: 0.25\nmode: safe\n")
    env = {"FERRY_DEMO_PORT": "2", "FERRY_DEMO_NAME": "from-env"}
    config = parse(["--config", str(file), "--port", "3"], env)
    assert (config.port, config.name, config.ratio, config.mode) == (3, "from-env", 0.25, Mode.SAFE)
    assert config.is_verbose is False  # default


def test_file_keys_may_use_dashes(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "demo.yaml"
    file.write_text("is-verbose: true\npeers: [a:1, b:2]\n")
    config = parse(["--config", str(file)])
    assert config.is_verbose is True and config.peers == ["a:1", "b:2"]


@pytest.mark.parametrize(("raw", "expected"), [
    ("true", True), ("1", True), ("Yes", True), ("on", True),
    ("false", False), ("0", False), ("no", False), ("OFF", False),
])
def test_bool_from_env(raw: str, expected: bool) -> None:
    assert parse(env={"FERRY_DEMO_IS_VERBOSE": raw}).is_verbose is expected


def test_bool_flag_alone_or_with_value() -> None:
    assert parse(["--is-verbose"]).is_verbose is True
    assert parse(["--is-verbose", "false"]).is_verbose is False


def test_enum_is_case_insensitive_and_errors_list_choices(capsys) -> None:
    assert parse(["--mode", "SAFE"]).mode is Mode.SAFE
    with pytest.raises(SystemExit):
        parse(["--mode", "turbo"])
    assert "expected one of fast, safe" in capsys.readouterr().err


def test_lists_and_tuples() -> None:
    config = parse(["--peers", "a:1, b:2,", "--sizes", "4,8"])
    assert config.peers == ["a:1", "b:2"]
    assert config.sizes == (4, 8)
    assert parse(env={"FERRY_DEMO_PEERS": ""}).peers == []


def test_optionals() -> None:
    assert parse(["--model-dir", "/m"]).model_dir == pathlib.Path("/m")
    assert parse().limit == 8
    assert parse(["--limit", "none"]).limit is None
    assert parse(env={"FERRY_DEMO_LIMIT": "16"}).limit == 16


def test_file_null_sets_optional_to_none(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "demo.yaml"
    file.write_text("limit: null\n")
    assert parse(["--config", str(file)]).limit is None


def test_bad_value_names_its_source(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(env={"FERRY_DEMO_PORT": "eighty"})
    assert "FERRY_DEMO_PORT: expected int, got 'eighty'" in capsys.readouterr().err


def test_post_init_validation_becomes_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--ratio", "2"])
    assert "--ratio must be at most 1" in capsys.readouterr().err


def test_config_file_errors(tmp_path: pathlib.Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--config", str(tmp_path / "missing.yaml")])
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(tmp_path / "list.yaml")])
    assert "expected a mapping" in capsys.readouterr().err


def test_config_file_from_env(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "demo.yaml"
    file.write_text("port: 7\n")
    assert parse(env={"FERRY_DEMO_CONFIG": str(file)}).port == 7


def test_help_mentions_env_names_defaults_and_choices() -> None:
    text = build_parser(DemoConfig, "demo").format_help()
    assert "FERRY_DEMO_PORT" in text and "FERRY_DEMO_IS_VERBOSE" in text
    assert "(default: 50051)" in text
    assert "one of: fast, safe" in text
    assert "50% of the time" in text


def test_required_field_missing_is_a_usage_error(capsys) -> None:
    @dataclasses.dataclass(frozen=True)
    class Required:
        instance_id: str = dataclasses.field(metadata={"help": "this instance's id"})
        etcd: str = knob("x", "etcd")

    with pytest.raises(SystemExit):
        parse_config(Required, "demo", [], {})
    assert "--instance-id" in capsys.readouterr().err
    assert parse_config(Required, "demo", ["--instance-id", "i-1"], {}).instance_id == "i-1"


def test_a_yaml_value_of_another_type_is_refused_not_coerced(tmp_path: pathlib.Path, capsys) -> None:
    """A YAML file gives typed values: `port: 8000.5` became port 8000, `ratio: yes` 1.0 and `name: off` 'False'."""
    for line, error in (("port: 8000.5", "demo.yaml:port: expected int, got 8000.5"),
                        ("port: true", "demo.yaml:port: expected int, got the boolean True"),
                        ("ratio: yes", "demo.yaml:ratio: expected float, got the boolean True"),
                        ("sizes: [1, 2.5]", "demo.yaml:sizes: expected int, got 2.5")):
        (tmp_path / "demo.yaml").write_text(line + "\n")
        with pytest.raises(SystemExit):
            parse(["--config", str(tmp_path / "demo.yaml")])
        assert error in capsys.readouterr().err
    (tmp_path / "demo.yaml").write_text("port: 8000.0\nratio: 1\nname: 2024\nis_verbose: yes\n")
    config = parse(["--config", str(tmp_path / "demo.yaml")])
    assert (config.port, config.ratio, config.name, config.is_verbose) == (8000, 1.0, "2024", True)


def test_a_yaml_list_or_mapping_for_a_single_value_is_refused_as_such(tmp_path: pathlib.Path, capsys) -> None:
    """A black-box run (2026-12-07): `max_num_seqs: [1, 2]` stopped an instance with Python's own "int() argument
    must be a string, a bytes-like object or a real number, not 'list'", and `name: [a, b]` became the name
    "['a', 'b']"; a JSON knob's mapping (`override_generation_config`) is still taken."""
    for line, error in (("port: [1, 2]", "demo.yaml:port: expected int, got a list [1, 2]"),
                        ("name: [a, b]", "demo.yaml:name: expected str, got a list ['a', 'b']"),
                        ("ratio: {a: 1}", "demo.yaml:ratio: expected float, got a mapping {'a': 1}"),
                        ("limit: [3]", "demo.yaml:limit: expected int, got a list [3]"),
                        ("model_dir: [m]", "demo.yaml:model_dir: expected Path, got a list ['m']")):
        (tmp_path / "demo.yaml").write_text(line + "\n")
        with pytest.raises(SystemExit):
            parse(["--config", str(tmp_path / "demo.yaml")])
        assert error in capsys.readouterr().err
    assert convert({"temperature": 0.5}, str) == '{"temperature": 0.5}'


def test_an_unknown_variable_of_the_services_prefix_is_refused_with_a_suggestion(capsys) -> None:
    """A black-box run (2026-12-07): FERRY_INSTANCE_KV_CACHE_MB=48 (an env file's typo of ..._MIB) was ignored
    without a word and the instance took the default 512 MiB, where the same typo in a --config file is refused.
    Other services' variables and other FERRY_ names are not this service's to judge."""
    with pytest.raises(SystemExit):
        parse(env={"FERRY_DEMO_PORTT": "1", "FERRY_DEMO_NAME": "x"})
    assert "unknown environment variable(s) FERRY_DEMO_PORTT (did you mean FERRY_DEMO_PORT?)" in capsys.readouterr().err
    env = {"FERRY_DEMO_PORT": "1", "FERRY_DEMO_CONFIG": "", "FERRY_OTHER_PORTT": "1", "FERRY_PORT_RANGE": "1-2"}
    assert parse(env=env).port == 1
    with pytest.raises(SystemExit):
        parse_config(InstanceConfig, "instance", [], {"FERRY_INSTANCE_KV_CACHE_MB": "48"})
    assert "FERRY_INSTANCE_KV_CACHE_MB (did you mean FERRY_INSTANCE_KV_CACHE_MIB?)" in capsys.readouterr().err


def test_a_text_knob_in_the_yaml_file_is_its_text_as_written(tmp_path: pathlib.Path) -> None:
    """YAML types a scalar before ferry knows the knob's type: `name: 0001` became '1' (an instance id that
    matched no other process's), `1.10` '1.1', `off` 'False', `0x1F` '31'. A str, path or list-of-str knob now takes
    the scalar's text; numbers, booleans, an explicit null and a JSON knob's mapping still read as YAML types them."""
    (tmp_path / "demo.yaml").write_text("name: 0001\nmodel_dir: 1.10\npeers: [0x1F, off, '007']\napi_key: 2024-01-01\n"
                                        "port: 0001\nis_verbose: off\nlimit: null\n")
    config = parse(["--config", str(tmp_path / "demo.yaml")])
    assert (config.name, config.model_dir, config.peers, config.api_key) == (
        "0001", pathlib.Path("1.10"), ["0x1F", "off", "007"], "2024-01-01")
    assert (config.port, config.is_verbose, config.limit) == (1, False, None)
    for line in ("name: off", "name: 1.10", "name: ~"):
        (tmp_path / "demo.yaml").write_text(line + "\n")
        assert parse(["--config", str(tmp_path / "demo.yaml")]).name == {"name: off": "off", "name: 1.10": "1.10",
                                                                          "name: ~": None}[line]


def test_convert_errors() -> None:
    with pytest.raises(ValueError, match="expected true or false"):
        convert("maybe", bool)
    with pytest.raises(TypeError, match="unsupported"):
        convert("x", dict)


def test_env_name_and_as_dict_hides_secrets() -> None:
    assert env_name("frontend", "http_port") == "FERRY_FRONTEND_HTTP_PORT"
    shown = as_dict(parse(["--api-key", "s3cret", "--model-dir", "/m"]))
    assert shown["api_key"] == "***" and shown["mode"] == "fast" and shown["model_dir"] == "/m"
    instance = as_dict(parse_config(InstanceConfig, "instance", ["--model", "m", "--max-num-batched-tokens", "256"],
                                    env={}))
    # numbers are never hidden, whatever their name
    assert instance["max_num_batched_tokens"] == 256 and instance["sim_prefill_ms_per_token"] != "***"



EVERY_SERVICE = [("frontend", FrontendConfig, ["--manager-address", "127.0.0.1:1"]),
                 ("instance", InstanceConfig, ["--model", "m"]), ("manager", ManagerConfig, []),
                 ("transfer", TransferConfig, [])]


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE)
def test_every_service_checks_its_log_flags_when_parsing(service: str, config_cls: type, required: list[str],
                                                         capsys) -> None:
    config = parse_config(config_cls, service, required, env={env_name(service, "log_level"): "WARNING",
                                                              env_name(service, "log_format"): "json"})
    assert (config.log_level, config.log_format) == (LogLevel.WARNING, LogFormat.JSON)
    assert as_dict(config)["log_level"] == "warning"
    with pytest.raises(SystemExit):
        parse_config(config_cls, service, [*required, "--log-level", "loud"], env={})
    assert "--log-level: expected one of debug, info, warning, error, critical, got 'loud'" in capsys.readouterr().err


def test_instance_sim_engine_flags_parse_and_a_negative_latency_is_refused(capsys) -> None:
    config = parse_config(InstanceConfig, "instance", ["--model", "m", "--engine", "sim", "--sim-step-ms", "20"],
                          env={env_name("instance", "sim_decode_ms_per_seq"): "0.5"})
    assert (config.engine.value, config.sim_step_ms, config.sim_decode_ms_per_seq) == ("sim", 20.0, 0.5)
    with pytest.raises(SystemExit):
        parse_config(InstanceConfig, "instance", ["--model", "m", "--sim-prefill-ms-per-token", "-1"], env={})
    assert "--sim-prefill-ms-per-token must be >= 0, got -1.0" in capsys.readouterr().err


def test_instance_transfer_backend_defaults_to_auto_and_names_one_or_refuses(capsys) -> None:
    assert parse_config(InstanceConfig, "instance", ["--model", "m"], env={}).transfer_backend.backend is None
    config = parse_config(InstanceConfig, "instance", ["--model", "m", "--transfer-backend", "shm"], env={})
    assert config.transfer_backend is BackendChoice.SHM and config.transfer_backend.backend is TransferBackend.SHM
    with pytest.raises(SystemExit):
        parse_config(InstanceConfig, "instance", ["--model", "m", "--transfer-backend", "rdma"], env={})
    assert "rdma" in capsys.readouterr().err


def test_instance_device_defaults_to_cpu_and_refuses_what_it_cannot_use(capsys) -> None:
    assert parse_config(InstanceConfig, "instance", ["--model", "m"], env={}).device == "cpu"
    refusals = [("tpu", "--device must be cpu, cuda or cuda:N, got 'tpu'"),
                ("gpu0", "--device must be cpu, cuda or cuda:N, got 'gpu0'"),
                ("cuda:64", "--device cuda:64: ")]  # no CUDA here, or not 64 GPUs
    for value, message in refusals:
        with pytest.raises(SystemExit):
            parse_config(InstanceConfig, "instance", ["--model", "m", "--device", value], env={})
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_config(InstanceConfig, "instance", ["--model", "m", "--device", "cuda"], env={})
        err = capsys.readouterr().err
        assert "sees no CUDA device" in err and "use --device cpu" in err
    else:
        with pytest.raises(SystemExit):
            parse_config(InstanceConfig, "instance", ["--model", "m", "--engine", "sim", "--device", "cuda"], env={})
        assert "the sim engine runs no model" in capsys.readouterr().err


def test_transfer_channel_flags_parse_and_out_of_range_values_are_refused(capsys) -> None:
    config = parse_config(TransferConfig, "transfer", ["--gloo-connections", "3", "--staging-buffers", "6"], env={})
    assert (config.gloo_connections, config.staging_buffers) == (3, 6)
    for flag, value, message in (("--staging-buffers", "1", "--staging-buffers must be 2..64, got 1"),
                                 ("--gloo-connections", "0", "--gloo-connections must be 1..16, got 0"),
                                 ("--heap-keep-mib", "4096", "--heap-keep-mib must be 0..2047, got 4096"),
                                 ("--nccl-device", "-1", "--nccl-device must be a CUDA device index >= 0, got -1")):
        with pytest.raises(SystemExit):
            parse_config(TransferConfig, "transfer", [flag, value], env={})
        assert message in capsys.readouterr().err


def test_a_port_out_of_range_is_refused_naming_its_source(capsys):
    with pytest.raises(SystemExit):
        parse_config(PortConfig, "demo", ["--metrics-port", "99999"], env={})
    assert "--metrics-port: a port is 0..65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(PortConfig, "demo", [], env={"FERRY_DEMO_PORT": "-1"})
    assert "FERRY_DEMO_PORT: a port is 0..65535" in capsys.readouterr().err


def test_an_unknown_key_in_the_config_file_is_refused_with_a_suggestion(tmp_path, capsys):
    path = tmp_path / "demo.yaml"
    path.write_text("prot: 5\nbogus_key: 1\n")
    with pytest.raises(SystemExit):
        parse_config(PortConfig, "demo", ["--config", str(path)], env={})
    error = capsys.readouterr().err
    assert "unknown option(s) bogus_key, prot (did you mean port?)" in error


@dataclasses.dataclass
class PortConfig:
    port: int = knob(0, "gRPC port")
    metrics_port: int = knob(0, "metrics port")


def test_the_step_token_budget_follows_the_device_unless_given() -> None:
    """On a CPU a 2048-token prefill chunk takes seconds, and every stream beside it stalls that long."""
    def budget(*argv: str) -> int:
        return parse_config(InstanceConfig, "instance", ["--model", "m", *argv], env={}).step_token_budget
    assert budget() == 512
    assert budget("--max-num-batched-tokens", "4096") == 4096


def test_a_prefill_chunk_size_a_step_could_not_always_take_is_refused(capsys) -> None:
    def config(*argv: str) -> InstanceConfig:
        return parse_config(InstanceConfig, "instance", ["--model", "m", *argv], env={})
    assert config("--prefill-chunk-tokens", "448").prefill_chunk_tokens == 448  # 512 - 64 on the CPU
    with pytest.raises(SystemExit):
        config("--prefill-chunk-tokens", "449")
    assert "--prefill-chunk-tokens must be between 1 and --max-num-batched-tokens less --max-num-seqs (448), " \
           "got 449" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config("--prefill-chunk-tokens", "-1")
    assert "--prefill-chunk-tokens must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("service, config_cls, argv, flag", [
    ("frontend", FrontendConfig, ["--etcd-endpoints", "127.0.0.1:2379,etcd"], "--etcd-endpoints 'etcd'"),
    ("frontend", FrontendConfig, ["--manager-address", "http://127.0.0.1:50051"], "--manager-address"),
    ("manager", ManagerConfig, ["--etcd-endpoints", "127.0.0.1:abc"], "--etcd-endpoints '127.0.0.1:abc'"),
    ("instance", InstanceConfig, ["--model", "m", "--transfer-address", "127.0.0.1:99999"], "--transfer-address"),
    ("transfer", TransferConfig, ["--etcd-endpoints", "etcd:0"], "--etcd-endpoints 'etcd:0'"),
])
def test_a_malformed_address_is_a_usage_error_naming_its_flag(service, config_cls, argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, service, argv, env={})
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
    # the forms compose and the systemd units write are accepted
    assert parse_config(ManagerConfig, "manager", ["--etcd-endpoints", "etcd:2379,10.0.0.7:2379"],
                        env={}).etcd_endpoints == ["etcd:2379", "10.0.0.7:2379"]


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "1e999"])
def test_a_float_knob_refuses_nan_and_infinity(raw: str, capsys) -> None:
    # nan passed every `< 0` check (a manager ran with --lease-ttl-s nan and failed later, a traceback in its log)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(ManagerConfig, "manager", ["--lease-ttl-s", raw], env={})
    assert exit_info.value.code == 2
    assert f"--lease-ttl-s: expected a finite number, got {raw!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(env={"FERRY_DEMO_RATIO": f"-{raw}"})
    assert parse(["--ratio", "0.75"]).ratio == 0.75


@pytest.mark.parametrize("service, config_cls, argv, error", [
    ("frontend", FrontendConfig, ["--manager-address", "127.0.0.1:1", "--shutdown-grace-s", "-1"],
     "--shutdown-grace-s must be >= 0"),
    ("frontend", FrontendConfig, ["--manager-address", "127.0.0.1:1", "--failed-instance-cooldown-s", "-5"],
     "--failed-instance-cooldown-s must be >= 0"),
    ("manager", ManagerConfig, ["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be >= 0"),
    ("instance", InstanceConfig, ["--model", "m", "--lease-ttl-s", "0"], "--lease-ttl-s must be at least 1"),
    ("instance", InstanceConfig, ["--model", "m", "--num-threads", "-1"], "--num-threads must be >= 0"),
    ("instance", InstanceConfig, ["--model", "m", "--load-report-interval-s", "0"],
     "--load-report-interval-s must be positive"),
    ("instance", InstanceConfig, ["--model", "m", "--shutdown-grace-s", "-1"], "--shutdown-grace-s must be >= 0"),
    # these two were refused only after the model had loaded (exit 1, seconds later)
    ("instance", InstanceConfig, ["--model", "m", "--priority-headroom-blocks", "-1"],
     "--priority-headroom-blocks must be >= 0"),
    ("instance", InstanceConfig, ["--model", "m", "--max-model-len", "-1"], "--max-model-len must be >= 0"),
    ("transfer", TransferConfig, ["--lease-ttl-s", "0.5"], "--lease-ttl-s must be at least 1"),
    ("transfer", TransferConfig, ["--transfer-timeout-s", "0"], "--transfer-timeout-s must be positive"),
    ("transfer", TransferConfig, ["--channel-timeout-s", "-1"], "--channel-timeout-s must be positive"),
    ("transfer", TransferConfig, ["--num-threads", "-1"], "--num-threads must be >= 0"),
])
def test_a_meaningless_number_is_a_usage_error(service, config_cls, argv, error, capsys) -> None:
    """Each of these started before (a flag audit): a negative grace or thread count, a lease etcd
    cannot grant, a load report loop with no pause."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, service, argv, env={})
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("service, config_cls, argv", [
    ("frontend", FrontendConfig, ["--manager-address", "127.0.0.1:1", "--frontend-id", "edge/1"]),
    ("transfer", TransferConfig, ["--transfer-id", "host a"]),
])
def test_frontend_and_transfer_ids_are_checked_as_instance_ids_are(service, config_cls, argv, capsys) -> None:
    # the id names an etcd key (frontends/<id>, transfer/<id>); before, `edge/1` registered frontends/edge/1
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, service, argv, env={})
    assert exit_info.value.code == 2
    assert "not an id: letters, digits" in capsys.readouterr().err


@pytest.mark.parametrize("service, config_cls", [("frontend", FrontendConfig), ("instance", InstanceConfig),
                                                 ("manager", ManagerConfig), ("transfer", TransferConfig)])
def test_help_shows_each_default_once_and_an_empty_one_as_empty(service, config_cls) -> None:
    # before: "unique id of this instance (default: <host>-<port>) [env ...] (default: )"
    text = " ".join(build_parser(config_cls, service).format_help().split())
    assert "(default: )" not in text
    assert "(default: empty)" in text
    for option in text.split(" --")[1:]:
        assert option.count("(default") <= 1, option


def test_a_usage_error_is_one_line_naming_the_flag(capsys) -> None:
    # before: argparse's whole usage (some 50 lines for an instance) above it, per restart of a failing unit
    with pytest.raises(SystemExit) as exit_info:
        parse_config(InstanceConfig, "instance", ["--model", "m", "--block-size", "many"], env={})
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "python -m services.instance: error: --block-size: expected int, got 'many'\n"


def test_the_frontend_help_does_not_promise_a_grpc_server_it_does_not_have() -> None:
    frontend = " ".join(build_parser(FrontendConfig, "frontend").format_help().split())
    instance = " ".join(build_parser(InstanceConfig, "instance").format_help().split())
    assert "this process's gRPC server" not in frontend  # it serves HTTP only; its token is only sent
    assert "required by this process's gRPC server" in instance


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE)
@pytest.mark.parametrize("name, error", [("", "--cluster is empty"), ("eu/prod", "--cluster 'eu/prod': not an id")])
def test_the_cluster_name_is_one_word(service, config_cls, required, name, error, capsys) -> None:
    # it is the etcd prefix /ferry/<cluster>/: before, '' gave /ferry//, and eu/prod nested under eu
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, service, [*required, "--cluster", name], env={})
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err
    assert parse_config(config_cls, service, [*required, "--cluster", "prod-eu.2"], env={}).cluster == "prod-eu.2"


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE)
@pytest.mark.parametrize("argv, error", [(["--etcd-endpoints", "etcd:0"], "--etcd-endpoints 'etcd:0'"),
                                         (["--etcd-wait-s", "-1"], "--etcd-wait-s must be 0..86400")])
def test_every_service_checks_its_etcd_flags(service, config_cls, required, argv, error, capsys) -> None:
    # one check (EtcdStartupKnobs.check_etcd_flags) for the flags every service declares
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, service, [*required, *argv], env={})
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_check_positive_and_non_negative_name_the_first_flag_off() -> None:
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        grace_s: float = 0.0
        timeout_s: float = 1.0
        step_ms: float = -1.0

    knobs = Knobs()
    check_positive(knobs, ("timeout_s",))
    check_non_negative(knobs, ("grace_s", "timeout_s"))
    with pytest.raises(ValueError, match=r"^--grace-s must be positive, got 0.0$"):
        check_positive(knobs, ("timeout_s", "grace_s"))
    with pytest.raises(ValueError, match=r"^--sim-step-ms must be >= 0, got -1.0$"):
        check_non_negative(knobs, ("grace_s", "step_ms"), flag_prefix="--sim-")
    with pytest.raises(ValueError, match="must be positive, got nan"):
        check_positive(Knobs(timeout_s=math.nan), ("timeout_s",))


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE)
@pytest.mark.parametrize("host", ["not a host", "http://x", "-lead", "a..b"])
def test_every_service_refuses_a_host_that_is_none(service, config_cls, required, host, capsys) -> None:
    # a bind host that is no address failed only at bind, naming --port first; an advertised
    # one was registered in etcd for every peer to fail to dial
    flags = ["--host"] if service == "frontend" else ["--host", "--advertise-host", "--metrics-host"]
    for flag in flags:
        with pytest.raises(SystemExit) as exit_info:
            parse_config(config_cls, service, [*required, f"{flag}={host}"], env={})
        assert exit_info.value.code == 2
        assert f"{flag} {host!r}: expected an IP address or a host name" in capsys.readouterr().err
    for good in ("0.0.0.0", "::", "[::1]", "instance-0.ferry_net", "localhost"):
        parse_config(config_cls, service, [*required, flags[-1], good], env={})


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE[1:])
@pytest.mark.parametrize("host", ["::1", "[::1]", "fe80::1"])
def test_grpc_services_refuse_an_ipv6_host_naming_the_flag(service, config_cls, required, host, capsys) -> None:
    # `--host ::1` bound, then advertised `::1:P` (no brackets) in etcd, which no peer could dial; and the etcd
    # client, records and gloo/nccl rendezvous are IPv4-only. Refused at startup instead (README "IPv6").
    for flag in ("--host", "--advertise-host"):
        with pytest.raises(SystemExit) as exit_info:
            parse_config(config_cls, service, [*required, f"{flag}={host}"], env={})
        assert exit_info.value.code == 2
        assert f"{flag} {host!r}: IPv6 addresses are not supported" in capsys.readouterr().err
    parse_config(config_cls, service, [*required, "--host", "::"], env={})  # every address, IPv4 too


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE[1:])
def test_an_ipv6_etcd_endpoint_is_refused_naming_the_flag(service, config_cls, required, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(config_cls, service, [*required, "--etcd-endpoints", "[::1]:2379"], env={})
    assert "--etcd-endpoints '[::1]:2379': IPv6 addresses are not supported" in capsys.readouterr().err


def test_the_frontend_may_serve_http_on_ipv6() -> None:
    assert parse_config(FrontendConfig, "frontend", ["--manager-address", "127.0.0.1:1", "--host", "::1"],
                        env={}).host == "::1"


@pytest.mark.parametrize("service, config_cls, required", EVERY_SERVICE)
def test_parsing_a_config_takes_a_few_milliseconds_of_cpu(service, config_cls, required) -> None:
    # Each field's type was looked up with typing.get_type_hints over the whole class, its ~80 string
    # annotations compiled again per field: ~90 ms of CPU per parse, and the tests above, which parse every
    # service's config a dozen times, ran past their 10 s at load 14 on two cores. CPU time, not wall time:
    # the same on a loaded machine.
    parse_config(config_cls, service, required, env={})  # anything imported once
    started = time.process_time()
    for _ in range(5):
        parse_config(config_cls, service, required, env={})
    assert (time.process_time() - started) / 5 < 0.03


def test_a_relative_model_folder_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch) -> None:
    """A black-box run (2026-12-07): `model: models/smollm2-135m-instruct` in a --config file, the service started
    from another folder, said only "no config.json in models/smollm2-135m-instruct": relative to what? The working
    directory, as every relative path of a flag, variable or file."""
    from services.frontend.served_model import ServedModel
    from services.instance.engine.model_config import ModelConfig

    monkeypatch.chdir(tmp_path)
    where = re.escape(f"models/x (relative to the working directory {tmp_path}, not to a --config file)")
    with pytest.raises(ValueError, match=f"no config.json in {where}: pass --model"):
        ModelConfig.from_dir("models/x")
    with pytest.raises(ValueError, match=f"--model {where}: cannot read"):
        ServedModel.load(pathlib.Path("models/x"), "x")
    with pytest.raises(ValueError, match=f"no config.json in {re.escape(str(tmp_path))}: pass"):
        ModelConfig.from_dir(tmp_path)
