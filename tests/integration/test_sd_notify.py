"""systemd readiness (`Type=notify`): a real service tells $NOTIFY_SOCKET READY=1 once it serves,
not before; outside systemd nothing is sent."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.sd_notify import notify_systemd

pytestmark = pytest.mark.timeout(90)


def test_nothing_is_sent_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify_systemd("READY=1")


@pytest.mark.parametrize("abstract", [False, True])
def test_the_state_reaches_the_socket(monkeypatch, tmp_path, abstract):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        name = f"\0ferry-notify-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify")
        systemd.bind(name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name[1:] if abstract else name)
        assert notify_systemd("READY=1")
        assert systemd.recv(64) == b"READY=1"


async def test_a_service_is_ready_for_systemd_once_it_serves(etcd, cluster, tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        systemd.settimeout(60)
        port = free_port()
        service = ServiceProcess("transfer", "transfer", ["--port", str(port), "--etcd-endpoints", etcd.endpoint,
                                                          "--cluster", cluster, "--num-threads", "1"],
                                 f"127.0.0.1:{port}", tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
        try:
            service.start()
            assert await asyncio.to_thread(systemd.recv, 64) == b"READY=1"
            await service.wait_healthy(1)  # it serves by the time it says so
        finally:
            stop_all([service])
