"""Configuration of one manager process (`python -m services.manager`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import knob
from services.manager.policies import POLICY_NAMES


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Cluster view, dispatch and admin API of a ferry cluster (ferry.v1.ManagerService + AdminService)."""

    host: str = knob("127.0.0.1", "address to bind the gRPC server to")
    port: int = knob(50051, "gRPC port for ManagerService and AdminService (0 = pick a free one)")
    advertise_host: str = knob("", "host other processes use to reach this manager (default: --host)")
    manager_id: str = knob("", "unique id of this manager (default: <hostname>-<port>)")
    etcd_endpoints: list[str] = knob(["127.0.0.1:2379"], "etcd endpoints host:port (comma-separated)")
    cluster: str = knob("ferry", "cluster name: etcd keys live under /ferry/<cluster>/")
    lease_ttl_s: float = knob(5.0, "leader lease TTL in seconds: a standby takes over at most this long after the leader dies")
    dispatch_policy: str = knob("load", f"dispatch policy until one is stored in etcd ({', '.join(POLICY_NAMES)})")
    report_timeout_s: float = knob(3.0, "an instance whose load reports stop for longer is UNHEALTHY (not dispatched to)")
    resync_interval_s: float = knob(10.0, "seconds between full re-reads of instances/ from etcd (the watch patches in between)")
    list_requests_timeout_s: float = knob(2.0, "deadline of each InstanceService/ListRequests call in the admin fan-out")
    admin_forward_timeout_s: float = knob(1.0, "deadline when a standby forwards an admin read to the leader")
    metrics_port: int = knob(0, "Prometheus /metrics HTTP port (0 = off)")
    shutdown_grace_s: float = knob(2.0, "seconds running calls get to finish on SIGTERM")
    log_format: str = knob("console", "log format: console or json")
    log_level: str = knob("info", "log level: debug, info, warning, error")

    def __post_init__(self) -> None:
        if self.dispatch_policy not in POLICY_NAMES:
            raise ValueError(f"--dispatch-policy must be one of {', '.join(POLICY_NAMES)}, got {self.dispatch_policy!r}")
        if not self.etcd_endpoints:
            raise ValueError("--etcd-endpoints is empty; the manager needs etcd (e.g. --etcd-endpoints 127.0.0.1:2379)")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s must be at least 1 (etcd leases are whole seconds), got {self.lease_ttl_s}")
        for name in ("report_timeout_s", "resync_interval_s", "list_requests_timeout_s", "admin_forward_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
