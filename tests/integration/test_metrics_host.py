"""--metrics-host: a service's /metrics can listen elsewhere than its gRPC server (before, it always
bound --host, so a Prometheus on another machine needed the gRPC port opened to it too). A real
transfer process (no etcd) with gRPC on 127.0.0.1 and /metrics on 127.0.0.2."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port

pytestmark = pytest.mark.timeout(120)


def _refuses(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_metrics_listen_on_metrics_host_and_grpc_on_host(tmp_path):
    port, metrics_port = free_port(), free_port()
    process = ServiceProcess("transfer", "transfer", ["--port", str(port), "--transfer-id", "t0", "--host", "127.0.0.1",
                                                      "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.2"],
                             f"127.0.0.1:{port}", tmp_path)
    process.start()
    try:
        asyncio.run(process.wait_healthy(60))
        with urllib.request.urlopen(f"http://127.0.0.2:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200 and b"ferry_transfer_transfers_total" in response.read()
        assert _refuses("127.0.0.1", metrics_port)
    finally:
        process.stop()
