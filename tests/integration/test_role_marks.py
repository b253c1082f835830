"""A role set at runtime outlives a crash of the instance (a real instance process, SIGKILLed and
started again with the same command line, against a real etcd); a changed `--role` wins."""

from __future__ import annotations

import pathlib

import grpc
import pytest

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.registry import Registry
from services.instance.role_marks import role_mark_key

pytestmark = pytest.mark.timeout(120)

INSTANCE = "role-0"


def instance(etcd: LocalEtcd, cluster: str, model: pathlib.Path, role: str, log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(INSTANCE, "instance", [
        "--port", str(port), "--model", str(model), "--instance-id", INSTANCE, "--role", role, "--engine", "sim",
        "--num-threads", "1", "--num-blocks", "64", "--etcd-endpoints", etcd.endpoint, "--cluster", cluster],
        f"127.0.0.1:{port}", log_dir)


async def set_role(process: ServiceProcess, role: int) -> None:
    async with grpc.aio.insecure_channel(process.address) as channel:
        reply = await instance_pb2_grpc.InstanceServiceStub(channel).SetRole(
            instance_pb2.SetRoleRequest(role=role), timeout=10)
    assert reply.role == role


async def started(process: ServiceProcess) -> ServiceProcess:
    process.start()
    await process.wait_healthy(60)
    return process


async def test_a_role_set_at_runtime_outlives_a_crash_until_the_command_line_changes(
        etcd, cluster, tiny_model_dir, tmp_path) -> None:
    registry = Registry([etcd.endpoint], cluster)
    process = None
    try:
        process = await started(instance(etcd, cluster, tiny_model_dir, "both", tmp_path))
        await set_role(process, common_pb2.ROLE_PREFILL)
        mark = await registry.get_json(role_mark_key(INSTANCE))
        assert (mark["role"], mark["command_line_role"]) == ("prefill", "both")

        process.kill()  # a crash: the launcher or systemd starts the same command line again
        process = await started(instance(etcd, cluster, tiny_model_dir, "both", tmp_path))
        assert (await registry.get_json(f"instances/{INSTANCE}"))["role"] == "prefill"
        assert "instance_role_restored" in process.log_tail(200)

        process.kill()  # an operator edits the unit: --role decode now
        process = await started(instance(etcd, cluster, tiny_model_dir, "decode", tmp_path))
        assert (await registry.get_json(f"instances/{INSTANCE}"))["role"] == "decode"
        assert await registry.get_json(role_mark_key(INSTANCE)) is None

        await set_role(process, common_pb2.ROLE_BOTH)
        assert (await registry.get_json(role_mark_key(INSTANCE)))["role"] == "both"
        await set_role(process, common_pb2.ROLE_DECODE)  # back to the command line's: no mark is needed
        assert await registry.get_json(role_mark_key(INSTANCE)) is None
    finally:
        if process is not None:
            process.stop()
        await registry.close()


async def test_a_mark_that_names_no_role_is_ignored(etcd, cluster, tiny_model_dir, tmp_path) -> None:
    registry = Registry([etcd.endpoint], cluster)
    await registry.put_json(role_mark_key(INSTANCE), {"role": "leader", "command_line_role": "both"})
    process = None
    try:
        process = await started(instance(etcd, cluster, tiny_model_dir, "both", tmp_path))
        assert (await registry.get_json(f"instances/{INSTANCE}"))["role"] == "both"
        assert "role_mark_ignored" in process.log_tail(200)
    finally:
        if process is not None:
            process.stop()
        await registry.close()
