"""Services started before etcd (a host booting, etcd restarting) wait for it for --etcd-wait-s,
then register and serve; a stop while they wait is a clean exit, not a failure."""

from __future__ import annotations

import pathlib
import signal
import time
import uuid

import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.registry import Registry
from tests.integration.eventually import eventually

pytestmark = pytest.mark.timeout(120)

WAITING = "etcd_not_answering_waiting"


def service(name: str, module: str, args: list[str], log_dir: pathlib.Path, http: bool = False) -> ServiceProcess:
    port = free_port()
    address = f"http://127.0.0.1:{port}" if http else f"127.0.0.1:{port}"
    return ServiceProcess(name, module, ["--port", str(port), *args], address, log_dir)


async def test_services_started_before_etcd_register_once_it_answers(tiny_model_dir, tmp_path) -> None:
    etcd = LocalEtcd()  # its ports are chosen, nothing listens there yet
    cluster = f"wait-{uuid.uuid4().hex[:8]}"
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--etcd-wait-s", "60"]
    transfer = service("t-0", "transfer", ["--transfer-id", "t-0", *common], tmp_path)
    instance = service("i-0", "instance", ["--model", str(tiny_model_dir), "--instance-id", "i-0", "--num-threads", "1",
                                           "--num-blocks", "64", "--engine", "sim", *common], tmp_path)
    frontend = service("f-0", "frontend", ["--model", str(tiny_model_dir), "--frontend-id", "f-0", *common], tmp_path,
                       http=True)
    processes = [transfer, instance, frontend]
    registry = Registry([etcd.endpoint], cluster)
    try:
        for process in processes:
            process.start()
        for process in processes:
            await eventually(lambda p=process: WAITING in p.log_tail(100), 60, f"{process.name} waiting for etcd")
        assert all(process.is_alive() for process in processes)
        await etcd.start_async()
        for process in processes:
            await process.wait_healthy(60)
        for kind, member in (("transfer", "t-0"), ("instances", "i-0"), ("frontends", "f-0")):
            assert await registry.get_json(f"{kind}/{member}") is not None, kind
        assert all("etcd_answered" in process.log_tail(200) for process in processes)
    finally:
        stop_all(processes)
        await registry.close()
        etcd.stop()


@pytest.mark.parametrize("module", ["transfer", "frontend"])
async def test_a_stop_while_waiting_for_etcd_is_a_clean_exit(module, tiny_model_dir, tmp_path) -> None:
    etcd_endpoint = f"127.0.0.1:{free_port()}"  # never started
    args = ["--etcd-endpoints", etcd_endpoint] + (["--model", str(tiny_model_dir)] if module == "frontend" else [])
    process = service(module, module, args, tmp_path, http=module == "frontend")
    try:
        process.start()
        await eventually(lambda: WAITING in process.log_tail(100), 60, "waiting for etcd")
        stopped_at = time.monotonic()
        process.signal(signal.SIGTERM)
        process.popen.wait(10)
        assert process.returncode == 0, process.log_tail()
        assert time.monotonic() - stopped_at < 5
        assert "stopped_before_ready" in process.log_tail() and "Traceback" not in process.log_tail()
    finally:
        stop_all([process])
