"""Single-machine cluster: etcd, manager, instances and frontend as child processes.

Start order: etcd, then the first manager with the transfer service(s), the instances and
the frontend, then, once that manager serves (so it leads), the standby managers; `ready`
once all are healthy. On SIGINT/SIGTERM/SIGHUP every child is
stopped by its PID (the frontend first, then the others side by side, then etcd), and
nothing else is touched. A child that exits on its own starts again (supervisor.py), unless
`--restart no`. If the launcher itself is
killed (SIGKILL, a crash), the kernel kills every child with it (PR_SET_PDEATHSIG). With TLS on
(`ClusterSpec.security`) every gRPC child serves and dials TLS and the health probes
dial it too; etcd stays plaintext on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import structlog

from services.common.error_text import error_text
from services.cluster.first_reports import FIRST_REPORTS_TIMEOUT_S, wait_for_first_reports
from services.cluster.processes import ServiceProcess, stop_all
from services.cluster.ready_banner import print_ready
from services.cluster.scaling_follower import align_stored_scaling, follow_scaling, reset_target
from services.cluster.security import ClusterSecurity
from services.cluster.supervisor import RestartPolicy, Supervisor, exited_cleanly, supervise_step
from services.cluster.state_dir import StateDirLock, StateDirUnusable
from services.common.events import wait_set
from services.common.etcd_launcher import LocalEtcd, free_port, reserve_port
from services.common.peer_address import host_port
from services.common.ports import bind_error
from services.common.registry import Registry
from services.manager.client import ManagerClient

log = structlog.get_logger(__name__)

HEALTH_TIMEOUT_S = 180.0  # --health-timeout-s: how long each child may take to answer its health check
# SIGTERM → SIGKILL: above any shutdown grace a child is given (their default is 5 s; a frontend
# finishing long streams may be given more), as systemd's TimeoutStopSec=30s in deploy/systemd.
STOP_TIMEOUT_S = 30.0
# --transfer-threads: torch threads of each transfer service (its gathers, scatters and same-host copies). torch's
# default, a thread per core, would contend with the instances, each pinned to its share of the cores.
TRANSFER_THREADS = 2


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model_dir: pathlib.Path
    roles: tuple[str, ...]  # one entry per instance: both | prefill | decode
    num_managers: int  # the first becomes leader, the others wait as standbys
    engine: str
    transfer_backend: str
    http_port: int
    admin_port: int
    state_dir: pathlib.Path | None
    cluster: str
    threads_per_instance: int
    kv_cache_mib: int
    log_format: str
    security: ClusterSecurity = ClusterSecurity()  # TLS / mTLS and the admin token; all off by default
    autoscale_max_instances: int = 0  # > 0: the manager scales between len(roles) and this many instances
    device: str = "cpu"  # cpu | cuda: instance i then runs on GPU i modulo the visible ones
    dtype: str = "float32"
    restart: RestartPolicy = RestartPolicy()  # children that exit on their own start again (supervisor.py)
    http_host: str = "127.0.0.1"  # where the frontend listens: this machine only, unless asked (0.0.0.0)
    health_timeout_s: float = HEALTH_TIMEOUT_S  # a child not healthy by then makes `up` fail, naming it
    frontend_args: tuple[str, ...] = ()  # --frontend-arg's words, after the launcher's flags (frontend_flags.py)
    transfer_threads: int = TRANSFER_THREADS  # each transfer service's --num-threads (0 = torch's default)

    def instance_device(self, index: int) -> str:
        return f"cuda:{gpu_index(index)}" if self.device == "cuda" else self.device

    @property
    def transfer_per_instance(self) -> bool:
        """nccl: each instance gets a transfer service of its own on its own GPU (NCCL refuses both
        ends of a pair on one GPU, so one service for the machine cannot pair with itself)."""
        return self.transfer_backend == "nccl"

    @property
    def is_scalable(self) -> bool:
        """Only clusters of `both` instances scale (scaling.py)."""
        return all(role == "both" for role in self.roles)

    @property
    def follows_scaling(self) -> bool:
        """Whether the launcher acts on the manager's scaling target: only with --autoscale-max-instances
        (a policy stored in the state dir, or set with ferryctl, never resizes a cluster started without it)."""
        return self.is_scalable and self.autoscale_max_instances > 0


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._tmp = None if spec.state_dir else tempfile.TemporaryDirectory(prefix="ferry-cluster-")
        self.state_dir = spec.state_dir or pathlib.Path(self._tmp.name)
        self._state_lock = StateDirLock(self.state_dir)
        self.etcd: LocalEtcd | None = None
        self.processes: list[ServiceProcess] = []
        self._next_instance_index = len(spec.roles)  # ids of instances added by scaling are never reused
        self.supervisor = Supervisor(spec.restart)  # restarts children that fail (supervisor.py)
        self.is_state_stale = False  # cluster.json could not be rewritten (a full disk): tried again each check

    @property
    def max_instances(self) -> int:
        return self.spec.autoscale_max_instances or len(self.spec.roles)

    def will_run(self, process: ServiceProcess) -> bool:
        """Alive, or exited on failure and about to be started again by the supervisor."""
        if process.is_alive():
            return True
        return not process.is_stopping() and self.supervisor.will_restart(process.name, not exited_cleanly(process.returncode))

    @property
    def frontend_url(self) -> str:
        host = self.spec.http_host if self.spec.http_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host_port(host, self.spec.http_port)}"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.spec.admin_port}"

    @property
    def admin_addresses(self) -> list[str]:
        """Every manager's admin address, manager-0's (--admin-port) first: any of them answers."""
        managers = [p.address for p in self.processes if p.name.startswith("manager-")]
        return [self.admin_address, *(a for a in managers if a != self.admin_address)]

    async def start(self) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateDirUnusable(f"--state-dir {self.state_dir}: cannot use it as a directory "
                                   f"({exc.strerror})") from exc
        self._state_lock.acquire()  # first: a second `up` on a held state dir names its holder, not a port
        if self.spec.security.generates_cluster_token:  # before any child: each is handed the file
            self.spec = replace(self.spec, security=self.spec.security.with_generated_cluster_token(self.state_dir))
        (self.state_dir / "cluster.json").unlink(missing_ok=True)  # a killed launcher's: not ready until we say so
        check_ports_free(self.spec)
        data_dir = self.state_dir / "etcd" if self.spec.state_dir else None
        # Ours before it is healthy: a signal while it starts must stop it (and remove its temp data dir)
        self.etcd = LocalEtcd(data_dir=data_dir, log_dir=self.state_dir / "logs")
        await self.etcd.start_async()
        if self.spec.follows_scaling:
            async with self.registry() as registry:
                await reset_target(registry, len(self.spec.roles))
                await align_stored_scaling(registry, len(self.spec.roles), self.spec.autoscale_max_instances)
        # The standbys only once the first manager serves, so it leads (the admin port is the leader's).
        # Everything else starts with it: each finds what it needs as it comes (an instance retries its
        # transfer service and waits for a leader to report to, the frontend watches etcd for instances),
        # and their imports (torch: seconds of CPU) need not wait for the manager's.
        leader, serving = self._manager(0), [*self._data_plane(), self._frontend()]
        self._start([leader, *serving])
        await self._wait_healthy([leader])
        standbys = [self._manager(i) for i in range(1, self.spec.num_managers)]
        self._start(standbys)
        await self._wait_healthy([*serving, *standbys])
        await self._wait_first_reports()
        self.write_state()

    def _data_plane(self) -> list[ServiceProcess]:
        """The transfer service(s) and the instances, each instance wired to its transfer service:
        one for the machine, or with nccl one per instance."""
        if not self.spec.transfer_per_instance:
            transfer = self._transfer(0)
            return [transfer, *(self._instance(i, role, transfer.address) for i, role in enumerate(self.spec.roles))]
        processes = []
        for i, role in enumerate(self.spec.roles):
            transfer = self._transfer(i)
            processes += [transfer, self._instance(i, role, transfer.address)]
        return processes

    async def add_instance(self) -> ServiceProcess:
        """Start one more `both` instance (scaling) and wait until it is healthy."""
        transfer_address = next(p.address for p in self.processes if p.name == "transfer-0")
        process = self._instance(self._next_instance_index, "both", transfer_address)
        self._next_instance_index += 1
        self._start([process])
        await self._wait_healthy([process])
        return process

    def registry(self) -> Registry:
        return Registry([self.etcd.endpoint], self.spec.cluster)

    def stop(self) -> None:
        """The frontend first (it stops taking requests), then every other child side by side, then etcd."""
        frontends = [process for process in self.processes if process.module == "frontend"]
        others = [process for process in reversed(self.processes) if process.module != "frontend"]
        for wave in (frontends, others):
            running = [process for process in wave if process.is_alive()]  # the others were reported as exited
            stop_all(running, STOP_TIMEOUT_S)
            for process in running:
                log.info("process_stopped", name=process.name, pid=process.pid)
        if self.etcd is not None:
            self.etcd.stop()
        if self._state_lock.is_held:  # else the state dir, cluster.json included, is another cluster's
            (self.state_dir / "cluster.json").unlink(missing_ok=True)  # it lists PIDs that are gone now
            self._state_lock.release()
        if self._tmp is not None:
            self._tmp.cleanup()

    def state(self) -> dict:
        processes = [{"name": "etcd", "pid": self.etcd.pid if self.etcd.is_running else None,
                      "address": self.etcd.endpoint, "metrics_url": f"http://{self.etcd.endpoint}/metrics"}]
        processes += [{"name": p.name, "pid": p.pid if p.is_alive() else None, "address": p.address,
                       "metrics_url": p.metrics_url} for p in self.processes]  # pid None: it exited (see the log)
        return {"frontend_url": self.frontend_url, "admin_address": self.admin_address,
                "admin_addresses": self.admin_addresses,
                "etcd_endpoint": self.etcd.endpoint, "cluster": self.spec.cluster,
                "model": str(self.spec.model_dir), **self.spec.security.state(), "processes": processes}

    def write_state(self) -> pathlib.Path:
        path = self.state_dir / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state(), indent=2))
        os.replace(tmp, path)
        return path

    def rewrite_state(self) -> None:
        """`write_state` while serving: a failure (a full disk) is logged and the write tried again on the
        next check, never a reason to stop the cluster."""
        try:
            self.write_state()
            self.is_state_stale = False
        except OSError as exc:
            if not self.is_state_stale:
                log.error("state_write_failed", path=str(self.state_dir / "cluster.json"), error=error_text(exc))
            self.is_state_stale = True

    def _start(self, processes: list[ServiceProcess]) -> None:
        for process in processes:
            process.start()
            self.processes.append(process)
            log.info("process_started", name=process.name, pid=process.pid, address=process.address)

    async def _wait_healthy(self, processes: list[ServiceProcess]) -> None:
        hint = " (--health-timeout-s: raise it for a child that needs longer, such as an instance loading a " \
               "large model)"
        await asyncio.gather(*(p.wait_healthy(self.spec.health_timeout_s, hint) for p in processes))

    async def _wait_first_reports(self) -> None:
        """Until the leader can dispatch to every instance (first_reports.py); bounded, then a warning."""
        security = self.spec.security
        instance_ids = [p.name for p in self.processes if p.name.startswith("instance-")]
        async with ManagerClient(self.admin_address, timeout_s=2.0, admin_token=security.admin_token(),
                                 tls=security.dial_tls()) as manager:
            silent = await wait_for_first_reports(manager, instance_ids)
        if silent:
            log.warning("first_load_reports_missing", instance_ids=sorted(silent), timeout_s=FIRST_REPORTS_TIMEOUT_S,
                        action="ready anyway: the leader dispatches to them once they report")

    def _common_args(self) -> list[str]:
        return ["--etcd-endpoints", self.etcd.endpoint, "--cluster", self.spec.cluster,
                "--log-format", self.spec.log_format]

    def _grpc_service(self, name: str, module: str, args: list[str], port: int) -> ServiceProcess:
        """A child with a gRPC server and a Prometheus /metrics port; its health probe dials TLS
        (with our certificate) when TLS is on."""
        security = self.spec.security
        metrics_port = free_port()
        return ServiceProcess(name, module, [*args, "--metrics-port", str(metrics_port)], f"127.0.0.1:{port}",
                              self.state_dir / "logs", tls=security.dial_tls(),
                              dies_with_parent=True, metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")

    def _manager(self, index: int) -> ServiceProcess:
        port = self.spec.admin_port if index == 0 else free_port()
        args = ["--port", str(port), "--manager-id", f"manager-{index}", *self._common_args(),
                *self.spec.security.manager_args(), *self._scaling_args()]
        return self._grpc_service(f"manager-{index}", "manager", args, port)

    def _scaling_args(self) -> list[str]:
        if not self.spec.autoscale_max_instances:
            return []
        return ["--scaling-enabled", "true", "--scaling-min-instances", str(len(self.spec.roles)),
                "--scaling-max-instances", str(self.spec.autoscale_max_instances)]

    def _transfer(self, index: int) -> ServiceProcess:
        """A transfer service maps the KV memory of the instances that use it (every one on this
        host, or with nccl instance `index` alone, whose GPU its nccl channels then use)."""
        port = free_port()
        default_backend = "grpc" if self.spec.transfer_backend == "auto" else self.spec.transfer_backend
        args = ["--port", str(port), "--transfer-id", f"transfer-{index}", "--default-backend", default_backend,
                "--num-threads", str(self.spec.transfer_threads), *self._common_args(),
                *self.spec.security.server_args()]
        if self.spec.transfer_per_instance:
            args += ["--backends", "grpc,nccl", "--nccl-device", str(gpu_index(index))]
        return self._grpc_service(f"transfer-{index}", "transfer", args, port)

    def _instance(self, index: int, role: str, transfer_address: str) -> ServiceProcess:
        port = free_port()
        args = ["--model", str(self.spec.model_dir), "--port", str(port), "--instance-id", f"instance-{index}",
                "--role", role, "--engine", self.spec.engine, "--num-threads", str(self.spec.threads_per_instance),
                "--kv-cache-mib", str(self.spec.kv_cache_mib), "--transfer-address", transfer_address,
                "--transfer-backend", self.spec.transfer_backend, "--device", self.spec.instance_device(index),
                "--dtype", self.spec.dtype, *self._common_args(),
                *self.spec.security.server_args()]
        return self._grpc_service(f"instance-{index}", "instance", args, port)

    def _frontend(self) -> ServiceProcess:
        args = ["--model", str(self.spec.model_dir), "--host", self.spec.http_host, "--port", str(self.spec.http_port),
                *self._common_args(),
                *self.spec.security.client_args(),  # its OpenAI API stays plain HTTP; its gRPC channels use TLS
                *self.spec.frontend_args]
        return ServiceProcess("frontend-0", "frontend", args, self.frontend_url, self.state_dir / "logs",
                              dies_with_parent=True, metrics_url=f"{self.frontend_url}/metrics")


def gpu_index(index: int) -> int:
    """Instance `index`'s GPU: index modulo the GPUs visible."""
    import torch  # only here: the launcher itself never needs torch

    return index % max(torch.cuda.device_count(), 1)


def check_ports_free(spec: ClusterSpec) -> None:
    """The fixed ports must be free before anything starts: a frontend or manager that cannot bind
    dies only after another cluster holding the port answered our health check for it."""
    for flag, port in (("--http-port", spec.http_port), ("--admin-port", spec.admin_port)):
        reserve_port(port)  # never given to a child (etcd, an instance) that starts before their owner
        if (error := bind_error("0.0.0.0", port)) is not None:
            raise PortInUse(f"{flag} {port} is already in use ({error.strerror}): another cluster or program "
                            f"holds it; stop it or pick another {flag}")


class PortInUse(RuntimeError):
    """A port the cluster needs is taken."""


async def run_until_signalled(cluster: LocalCluster) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal went away
        loop.add_signal_handler(sig, stop.set)
    try:
        start = asyncio.ensure_future(cluster.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()  # raises if a child failed to come up
            await print_ready(cluster)
            await _watch(cluster, stop)
        else:
            start.cancel()
    finally:
        cluster.stop()


async def _watch(cluster: LocalCluster, stop: asyncio.Event) -> None:
    """Watch the children, and follow the manager's scaling decisions when the cluster autoscales."""
    if not cluster.spec.follows_scaling:
        await _watch_children(cluster, stop)
        return
    async with cluster.registry() as registry:
        follower = asyncio.create_task(follow_scaling(cluster, registry, stop), name="follow_scaling")
        try:
            await _watch_children(cluster, stop)
        finally:  # a signal must not wait for an instance the follower is starting (its model may load for minutes)
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower


async def _watch_children(cluster: LocalCluster, stop: asyncio.Event) -> None:
    """Until a signal: report children that exit on their own and, with --restart on-failure,
    start them again (supervisor.py); cluster.json then lists their new pids."""
    while not stop.is_set():
        children = [*cluster.processes, EtcdChild(cluster.etcd)]
        if await supervise_step(cluster.supervisor, children, time.monotonic()) or cluster.is_state_stale:
            cluster.rewrite_state()
        await wait_set(stop, 1.0)


@dataclass(frozen=True, slots=True)
class EtcdChild:
    """The launcher's etcd as a supervised child: it starts again on its ports and data dir."""

    etcd: LocalEtcd
    name: str = "etcd"
    # The cluster cannot run without its store: any exit is a failure and it starts again, also after
    # someone else's SIGTERM (which etcd exits by).
    any_exit_fails: ClassVar[bool] = True

    @property
    def log_path(self) -> pathlib.Path:
        return self.etcd.log_path

    @property
    def pid(self) -> int | None:
        return self.etcd.pid

    @property
    def returncode(self) -> int | None:
        return self.etcd.returncode

    def is_alive(self) -> bool:
        return self.etcd.is_running

    def is_stopping(self) -> bool:
        return False

    async def restart(self) -> int | None:
        self.etcd.terminate()  # already exited: this only closes its log
        return (await self.etcd.start_async()).pid
