"""A transfer service restarted with another --advertise-host: its instance names the new address, in its etcd record
and in the reservations it hands migration sources, without restarting. Real processes (a sim-engine instance and
its transfer service, started as an operator starts them), a real etcd, stopped by PID.

Before, the instance read the advertised address once, when it first mapped its KV memory: after the restart it
mapped the memory again but went on naming the old address, so sources sent their blocks there.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.registry import Registry
from services.instance.client import InstanceClients

pytestmark = pytest.mark.timeout(150)

INSTANCE = "i-readvertise"


def _transfer(port: int, advertise_host: str, common: list[str], log_dir) -> ServiceProcess:
    return ServiceProcess("transfer-0", "transfer", ["--port", str(port), "--host", "127.0.0.1", "--advertise-host",
                                                     advertise_host, "--transfer-id", "t-0", "--num-threads", "1",
                                                     "--staging-kib", "64", *common], f"127.0.0.1:{port}", log_dir)


async def _record_names(registry: Registry, address: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (record := await registry.get_json(f"instances/{INSTANCE}") or {}).get("transfer_address") != address:
        if time.monotonic() > deadline:
            raise AssertionError(f"the instance's record names {record.get('transfer_address')!r}, not {address!r}")
        await asyncio.sleep(0.2)
    return record


async def test_an_instance_names_its_transfer_services_new_advertised_address(etcd, cluster, tiny_model_dir,
                                                                               tmp_path):
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--lease-ttl-s", "3"]
    transfer_port, instance_port = free_port(), free_port()
    transfer = _transfer(transfer_port, "127.0.0.1", common, tmp_path)
    instance = ServiceProcess(INSTANCE, "instance", [
        "--model", str(tiny_model_dir), "--port", str(instance_port), "--instance-id", INSTANCE, "--num-threads", "1",
        "--num-blocks", "32", "--block-size", "4", "--max-model-len", "64", "--engine", "sim", "--sim-step-ms", "1",
        "--transfer-address", f"127.0.0.1:{transfer_port}", *common], f"127.0.0.1:{instance_port}", tmp_path)
    processes = [transfer, instance]
    try:
        transfer.start()
        await transfer.wait_healthy(60)
        instance.start()
        await instance.wait_healthy(90)
        async with Registry([etcd.endpoint], cluster) as registry:
            await _record_names(registry, f"127.0.0.1:{transfer_port}")
            transfer.stop()
            processes[0] = transfer = _transfer(transfer_port, "localhost", common, tmp_path).start()
            await transfer.wait_healthy(60)
            await _record_names(registry, f"localhost:{transfer_port}")
        clients = InstanceClients(timeout_s=10)
        try:
            client, migration_id = clients(instance.address), f"m-{uuid.uuid4().hex[:8]}"
            reservation = await client.prepare_migrate_in(migration_id, "r-0", "i-source", 1)
            assert (reservation.transfer_address, reservation.transfer_id) == (f"localhost:{transfer_port}", "t-0")
            assert await client.abort_migrate_in(migration_id)
        finally:
            await clients.close()
        assert "transfer_service_changed" in instance.log_tail(200)
    finally:
        stop_all(processes)
