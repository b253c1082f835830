"""Child service processes: start, wait until healthy, stop by PID.

Used by the single-machine launcher and by integration tests, so both start
services exactly the way an operator would (`python -m services.<name> ...`).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import die_with_parent
from services.common.grpc_server import secure_or_insecure_channel
from services.common.log_files import rotate_log
from services.common.tls import TlsConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The gRPC service each kind of child serves: its health probe asks for that service, so
# another gRPC server that happens to hold the port (say etcd, after a port clash) never
# passes for it.
HEALTH_SERVICES = {"manager": "ferry.v1.ManagerService", "instance": "ferry.v1.InstanceService",
                   "transfer": "ferry.v1.TransferService"}


def child_python_path(environ: Mapping[str, str] = os.environ) -> str:
    """PYTHONPATH for a child `python -m services...`: this checkout first, then this process's own
    entries (packages installed only there, say wheels unpacked with `pip install --target` on a GPU
    machine, must reach the child too)."""
    inherited = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return os.pathsep.join([str(ROOT), *inherited])


class ProcessDied(RuntimeError):
    pass


class TlsRejected(RuntimeError):
    """The child serves, but the health probe's TLS check rejects it: a setup error, not a slow start."""


NUM_TLS_REJECTIONS = 3  # consecutive probes that name a TLS failure before giving up on a child


def tls_rejection_hint(probe: str, address: str) -> str | None:
    """What to fix, if a failed health check says the TLS check rejected the server."""
    if "Hostname Verification" in probe:
        return (f"its certificate does not name the address the probe dials ({address}); add that host as a "
                "subjectAltName (IP:127.0.0.1 for a local cluster)")
    if "handshake failed" in probe.lower() or "CERTIFICATE_VERIFY_FAILED" in probe:
        return "the TLS handshake failed; is its certificate signed by the CA given as --tls-ca?"
    return None


@dataclass(slots=True)
class ServiceProcess:
    """One child process running `python -m services.<module> <args>`."""

    name: str
    module: str
    args: list[str]
    address: str  # host:port of its gRPC server, or its HTTP base URL
    log_dir: pathlib.Path
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "host-b"]
    tls: TlsConfig | None = None  # how the health probe dials a TLS gRPC server
    # SIGKILLed if this process dies without stopping it (start() must then run on a
    # thread that lives as long as the child: the signal follows the thread that forked).
    dies_with_parent: bool = False
    popen: subprocess.Popen | None = None
    last_probe: str = ""  # what the last gRPC health probe saw: SERVING, another status, or the error
    stopping: bool = False  # stopped on purpose (stop_all): a supervisor must not start it again
    metrics_url: str = ""  # its Prometheus /metrics, where it serves one
    any_exit_fails: ClassVar[bool] = False  # exit 0 or by SIGTERM/SIGINT: left down, as systemd does

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def log_path(self) -> pathlib.Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> ServiceProcess:
        self.stopping = False
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": child_python_path(), "PYTHONUNBUFFERED": "1", **self.env}
        rotate_log(self.log_path)
        with open(self.log_path, "ab") as log_file:
            command = [*self.prefix, sys.executable, "-m", f"services.{self.module}", *self.args]
            if self.dies_with_parent:
                command = die_with_parent.command(command)
            self.popen = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        return self

    def is_alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.popen else None

    def is_stopping(self) -> bool:
        return self.stopping

    async def restart(self) -> int:
        """Start it again after it exited, with the same command line (port, id); returns the new pid.
        On the event loop's thread, which lives as long as the child (see `dies_with_parent`)."""
        return self.start().pid

    async def wait_healthy(self, timeout_s: float, timeout_hint: str = "") -> None:
        """Poll gRPC health (or GET /health for HTTP) until SERVING; raise if the process dies, and
        TimeoutError (with `timeout_hint` after the time) if it is not SERVING within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        num_rejections = 0
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise ProcessDied(f"{self.name} exited with {self.popen.returncode}; last log lines:\n{self.log_tail()}")
            if await self._probe():
                return
            hint = tls_rejection_hint(self.last_probe or "", self.address)
            num_rejections = num_rejections + 1 if hint else 0
            if num_rejections == NUM_TLS_REJECTIONS:
                raise TlsRejected(f"{self.name} at {self.address} is up, but the TLS check rejects it: {hint} "
                                  f"(health check: {self.last_probe})")
            await asyncio.sleep(0.2)
        probe = f" (last health check: {self.last_probe})" if self.last_probe else ""
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:g} s{timeout_hint}{probe}; "
                           f"last log lines:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.is_alive():
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL (fault tests)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        stop_all([self], timeout_s)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    async def _probe(self) -> bool:
        if self.address.startswith("http"):
            return await _http_healthy(self.address)
        self.last_probe = await grpc_health_status(self.address, tls=self.tls,
                                                   service=HEALTH_SERVICES.get(self.module, ""))
        return self.last_probe == "SERVING"


def stop_all(processes: Iterable[ServiceProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM every one at once, then wait for them all; SIGKILL any still running after `timeout_s`.
    They shut down side by side, so this takes as long as the slowest, not the sum."""
    processes = list(processes)
    for process in processes:
        process.stopping = True
    running = [process for process in processes if process.is_alive()]
    for process in running:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in running:
        try:
            process.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


async def grpc_health_status(address: str, timeout_s: float = 1.0, tls: TlsConfig | None = None,
                             service: str = "") -> str:
    """SERVING, another status name, or the RPC error (a TLS handshake failure names its cause),
    for `service` ("" = the server as a whole)."""
    async with secure_or_insecure_channel(address, tls) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                       timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def _http_healthy(base_url: str, timeout_s: float = 1.0) -> bool:
    """A ferry frontend's /health says ok (another server on the port, even one with a /health of its
    own, such as etcd's, does not count)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{base_url}/health") as response:
                body = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "ok"
