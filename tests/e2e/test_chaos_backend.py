"""benchmarks/chaos.py --transfer-backend reaches the cluster it starts: every instance is
started with it, the transfer service offers it by default, and the live migrations of a
flooded workload report it."""

from __future__ import annotations

import asyncio
import pathlib
import sys

import grpc
import pytest

from services.common.gen.ferry.v1 import manager_pb2
from tests.e2e.fault_cluster import Stream, client_session
from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(300)


def cmdline(pid: int) -> list[str]:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


async def committed_backends(cluster) -> list[str]:
    """The backends of the live migrations a flooded workload of 8 streams made: the migration loop's, and
    one asked of the admin API while they run (the loop alone may make none before short streams end)."""
    await cluster.set_policy(dispatch="flood", migration_enabled=True, migration_threshold=0.0)
    streams = [Stream(f"backend check {n}", 160) for n in range(8)]
    async with client_session() as session:
        running = asyncio.gather(*(s.run(session, cluster.frontend_url, cluster.model_name) for s in streams))
        await migrate_one_while(running, cluster)
        await running
    assert all(s.is_ok for s in streams), [s.error for s in streams]
    reply = await cluster.admin("ListMigrations", manager_pb2.ListMigrationsRequest())
    return [m.backend for m in reply.migrations if m.outcome == "committed"]


# shm's long form only (the flag's path is the same; `make test` keeps the suite short with gloo's)
async def migrate_one_while(running: asyncio.Future, cluster) -> None:
    """Ask the admin API to migrate a request of the busiest instance until one commits or the streams end
    (refusals are expected while the loop's migrations hold the slots or no request is movable yet)."""
    while not running.done():
        try:
            await cluster.admin("Migrate", manager_pb2.MigrateRequest(), timeout_s=30.0)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("shm", marks=pytest.mark.slow)])
def test_transfer_backend_flag_reaches_the_processes(backend, tiny_model_dir, tmp_path, monkeypatch):
    chaos = load_benchmark(ROOT / "benchmarks" / "chaos.py", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["chaos.py", "--instances", "2", "--transfer-backend", backend])
    args = chaos.parse_args()
    with chaos.chaos_cluster(args, tiny_model_dir, tmp_path / "state").running() as cluster:
        for name in cluster.names("instance"):
            assert flag(cmdline(cluster.process(name).pid), "--transfer-backend") == backend
        assert flag(cmdline(cluster.process("transfer-0").pid), "--default-backend") == backend
        backends = asyncio.run(committed_backends(cluster))
    assert backends and set(backends) == {backend}, backends
