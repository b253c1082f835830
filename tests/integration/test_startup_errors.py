"""A service that cannot start says why in one log line and exits 1: no traceback, no asyncio
noise, whatever the cause (a model folder that is not one, a port that is taken, etcd not
answering). This is what an operator reads in the journal of a crash-looping unit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest

from services.cluster.processes import ROOT
from services.common.etcd_launcher import free_port

# Generous: a start imports torch, and a loaded 2-core machine took over 90 s for one (each start is ~3 s when quiet).
pytestmark = pytest.mark.timeout(600)


def start(service: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"services.{service}", *argv], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_one_line_failure(result: subprocess.CompletedProcess, event: str, *words: str) -> None:
    assert result.returncode == 1, result.stderr[-2000:]
    failure = [line for line in result.stderr.splitlines() if event in line]
    assert len(failure) == 1 and all(word in failure[0] for word in words), result.stderr[-2000:]
    for noise in ("Traceback", "Event loop is closed", "never awaited"):
        assert noise not in result.stderr, result.stderr[-2000:]


@pytest.fixture
def taken_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_model_folder_that_is_not_one(tmp_path):
    assert_one_line_failure(start("instance", "--model", str(tmp_path / "nope")), "startup_failed", "no config.json")
    assert_one_line_failure(start("frontend", "--model", str(tmp_path / "nope"), "--manager-address", "127.0.0.1:1"),
                            "startup_failed", "config.json")


def test_a_taken_port(taken_port):
    assert_one_line_failure(start("manager", "--port", str(taken_port), "--etcd-endpoints", "127.0.0.1:1"),
                            "startup_failed", "cannot bind", "--port")
    assert_one_line_failure(start("transfer", "--metrics-port", str(taken_port)),
                            "startup_failed", f"--metrics-port {taken_port}")
    assert_one_line_failure(start("manager", "--port", "0", "--metrics-port", str(taken_port),
                                  "--etcd-endpoints", "127.0.0.1:1"), "startup_failed", f"--metrics-port {taken_port}")


def test_etcd_not_answering_at_startup(tiny_model_dir):
    etcd = f"127.0.0.1:{free_port()}"
    gave_up = ("did not answer within --etcd-wait-s 1", etcd)
    assert_one_line_failure(start("transfer", "--etcd-endpoints", etcd, "--etcd-wait-s", "1"), "service_failed",
                            *gave_up)
    assert_one_line_failure(start("instance", "--model", str(tiny_model_dir), "--etcd-endpoints", etcd,
                                  "--etcd-wait-s", "1", "--num-threads", "1", "--num-blocks", "64"), "service_failed",
                            *gave_up)


def test_a_generation_config_a_request_could_not_send(tmp_path, tiny_model_dir):
    """A model's sampling default that no request could send stops the frontend, naming the file
    and the field; an override that is no JSON object is a usage error (exit 2) naming the flag."""
    (tmp_path / "generation_config.json").write_text('{"temperature": -1, "top_p": 0.9}')
    assert_one_line_failure(start("frontend", "--model", str(tiny_model_dir), "--generation-config", str(tmp_path),
                                  "--manager-address", "127.0.0.1:1"),
                            "startup_failed", f"{tmp_path / 'generation_config.json'}: temperature: must be between")
    result = start("frontend", "--manager-address", "127.0.0.1:1", "--override-generation-config", "{temperature")
    assert result.returncode == 2 and "--override-generation-config: not valid JSON" in result.stderr, result.stderr


def test_a_manager_with_an_etcd_user_waits_for_etcd_then_says_why():
    """A manager without an etcd user starts without etcd (a standby until it can campaign); with one
    it must authenticate first. Before, it exited 1 at once with a traceback (Auth.Authenticate failed)."""
    etcd = f"127.0.0.1:{free_port()}"
    assert_one_line_failure(start("manager", "--port", "0", "--etcd-endpoints", etcd, "--etcd-user", "ferry",
                                  "--etcd-password", "pw", "--etcd-wait-s", "1"), "service_failed",
                            "did not answer within --etcd-wait-s 1", etcd)


def test_grpc_services_refuse_ipv6_naming_the_flag():
    """They bound `::1` and advertised `::1:P`, which no peer could dial (README "IPv6"). The refusal is
    parse_config's, which tests/unit/common/test_config.py checks in-process for every service and flag
    (--host, --advertise-host, --etcd-endpoints); here, once, that a real process exits 2 with it."""
    result = start("manager", "--host", "::1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--host '::1': IPv6 addresses are not supported" in result.stderr, result.stderr[-2000:]


def test_a_frontend_serves_http_on_ipv6_loopback(tiny_model_dir):
    """Its address (the ready line, its etcd record) is `[::1]:P`, a URL clients can use; was `::1:P`."""
    process = subprocess.Popen([sys.executable, "-m", "services.frontend", "--model", str(tiny_model_dir),
                                "--manager-address", "127.0.0.1:1", "--host", "::1", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        ready = process.stdout.readline().split()
        assert ready[:1] == ["ready"] and ready[2].startswith("http://[::1]:"), ready
        with urllib.request.urlopen(f"{ready[2]}/v1/models", timeout=10) as response:
            assert response.status == 200
    finally:
        process.terminate()
        process.wait(30)


def test_a_second_process_under_a_live_ones_id_refuses_to_start(etcd, cluster):
    """Two transfer services started with one --transfer-id: the second overwrote the first's record and
    both answered to the id. Now it waits out the holder's lease, then says who holds the id and exits 1."""
    flags = ("--transfer-id", "t-dup", "--etcd-endpoints", etcd.endpoint, "--cluster", cluster,
             "--lease-ttl-s", "1", "--port", "0", "--metrics-port", "0")
    first = subprocess.Popen([sys.executable, "-m", "services.transfer", *flags], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        ready = first.stdout.readline().split()
        assert ready[:1] == ["ready"], ready
        second = start("transfer", *flags)
        assert_one_line_failure(second, "service_failed", "FAILED_PRECONDITION", "t-dup",
                                "registered by another live process", f"at {ready[2]}")
        assert first.poll() is None  # the holder goes on
    finally:
        first.terminate()
        first.wait(30)
