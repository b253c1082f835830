"""Configuration of one manager process (`python -m services.manager`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.auth import read_token
from services.common.config import check_non_negative, check_positive, knob
from services.common.errors import InvalidArgument
from services.common.etcd_client import EtcdKnobs, EtcdStartupKnobs
from services.common.etcd_endpoints import check_grpc_host_flags, check_host_flags
from services.common.ids import check_id_flag
from services.common.logging import LogKnobs
from services.common.tls import TlsKnobs
from services.manager.migration import MigrationSelection, MigrationSettings
from services.manager.migration_policies import PAIRING_NAMES
from services.manager.policies import DEFAULT_PREFIX_LOAD_SLACK, POLICY_NAMES
from services.manager.scaling import ScalingSettings

_BACKENDS = ("", "grpc", "gloo", "nccl", "shm")


@dataclass(frozen=True, slots=True)
class ManagerConfig(EtcdKnobs, EtcdStartupKnobs, TlsKnobs, LogKnobs):
    """Cluster view, dispatch and admin API of a ferry cluster (ferry.v1.ManagerService + AdminService)."""

    host: str = knob("127.0.0.1", "address to bind the gRPC server to")
    port: int = knob(50051, "gRPC port for ManagerService and AdminService (0 = pick a free one)")
    advertise_host: str = knob("", "host other processes use to reach this manager (default: --host)")
    manager_id: str = knob("", "unique id of this manager (default: <hostname>-<port>); one a live manager holds "
                               "in etcd stops this one at startup (exit 1)")
    etcd_endpoints: list[str] = knob(["127.0.0.1:2379"], "etcd endpoints host:port (comma-separated)")
    cluster: str = knob("ferry", "cluster name: etcd keys live under /ferry/<cluster>/")
    etcd_wait_s: float = knob(60.0, "with --etcd-user, how long to wait at startup for etcd to answer (it must "
                                    "authenticate the manager first) before exiting 1 (0: at once); without a user "
                                    "the manager starts at once and serves as a standby until it can campaign")
    lease_ttl_s: float = knob(5.0, "leader lease TTL in seconds: a standby takes over at most this long after the leader dies")
    dispatch_policy: str = knob("load", f"dispatch policy until one is stored in etcd ({', '.join(POLICY_NAMES)})")
    prefix_load_slack: int = knob(DEFAULT_PREFIX_LOAD_SLACK, "dispatch policy prefix: a request goes to the instance "
                                  "that most likely caches its prompt prefix only if that instance's queue (running + "
                                  "waiting requests) is at most this many longer than the shortest; else by load")
    report_timeout_s: float = knob(3.0, "an instance whose load reports stop for longer is UNHEALTHY (not dispatched to)")
    resync_interval_s: float = knob(10.0, "seconds between full re-reads of instances/ from etcd (the watch patches in between)")
    list_requests_timeout_s: float = knob(2.0, "deadline of each InstanceService/ListRequests call in the admin fan-out")
    admin_forward_timeout_s: float = knob(1.0, "deadline when a standby forwards an admin read to the leader")
    migration_enabled: bool = knob(False, "the load-balancing migration loop, until a policy is stored in etcd (SetPolicy); drains migrate regardless")
    migration_threshold: float = knob(1.0, "migrate when the freeness gap (blocks per running request) exceeds this, until a policy is stored")
    migration_selection: MigrationSelection = knob(MigrationSelection.SHORTEST_RUNNING, "which request a source hands over, until a policy is stored")
    migration_pairing: str = knob("load", f"how sources and destinations are paired, until a policy is stored ({', '.join(PAIRING_NAMES)})")
    migration_interval_s: float = knob(0.5, "seconds between ticks of the migration loop (leader only)")
    migration_max_per_instance: int = knob(1, "migrations one instance takes part in at once (as source or destination); load-balancing moves stay one at a time per instance, drains and PD hand-offs use the rest")
    migration_cooldown_s: float = knob(10.0, "seconds a request that just migrated is not picked again by the loop")
    migration_timeout_s: float = knob(60.0, "deadline of one InstanceService/MigrateOut call")
    migration_history_size: int = knob(256, "migration records kept for ListMigrations, in memory and in etcd "
                                            "(oldest dropped first)")
    migration_failure_backoff_s: float = knob(2.0, "seconds a (source, destination) pair waits after a failed migration")
    migration_backend: str = knob("", "transfer backend migrations ask for: grpc, gloo, nccl, shm (empty = each instance's default)")
    scaling_enabled: bool = knob(False, "ask for instances and retire them to keep the average freeness in "
                                        "[--scaling-low-freeness, --scaling-high-freeness], until a policy is stored")
    scaling_low_freeness: float = knob(4.0, "scaling: below this average freeness, ask for one more instance")
    scaling_high_freeness: float = knob(256.0, "scaling: above this average freeness, retire one instance")
    scaling_min_instances: int = knob(1, "scaling: never retire below this many instances")
    scaling_max_instances: int = knob(4, "scaling: never ask for more than this many instances")
    scaling_interval_s: float = knob(1.0, "seconds between ticks of the scaling loop (leader only)")
    scaling_cooldown_s: float = knob(60.0, "seconds after a scaling action before the next one")
    pd_short_prompt_tokens: int = knob(0, "PD disaggregation: prompts shorter than this many tokens may prefill on a "
                                          "decode instance directly, skipping the hand-off (0 = off)")
    metrics_port: int = knob(0, "Prometheus /metrics HTTP port (0 = off)")
    metrics_host: str = knob("", "address to bind the Prometheus /metrics endpoint to (default: --host, as the gRPC "
                                 "server; e.g. 0.0.0.0 for a Prometheus on another machine, gRPC left on 127.0.0.1)")
    shutdown_grace_s: float = knob(2.0, "seconds running calls get to finish on SIGTERM")
    admin_token: str = knob("", "bearer token AdminService calls must carry (`authorization: Bearer TOKEN`); "
                                "empty = admin API open (health and reflection are always open)")
    admin_token_file: str = knob("", "file holding --admin-token (instead of the flag or the env variable)")

    def __post_init__(self) -> None:
        check_id_flag("--manager-id", self.manager_id)
        self.check_etcd_flags(self.cluster, self.etcd_endpoints)
        check_host_flags(self, ("host", "advertise_host", "metrics_host"))
        check_grpc_host_flags(self, ("host", "advertise_host"))
        if not self.etcd_endpoints:
            raise ValueError("--etcd-endpoints is empty; the manager needs etcd (e.g. --etcd-endpoints 127.0.0.1:2379)")
        if self.dispatch_policy not in POLICY_NAMES:
            raise ValueError(f"--dispatch-policy must be one of {', '.join(POLICY_NAMES)}, got {self.dispatch_policy!r}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s must be at least 1 (etcd leases are whole seconds), got {self.lease_ttl_s}")
        check_positive(self, ("report_timeout_s", "resync_interval_s", "list_requests_timeout_s",
                              "admin_forward_timeout_s", "migration_interval_s", "migration_timeout_s",
                              "migration_max_per_instance", "migration_history_size", "scaling_interval_s"))
        check_non_negative(self, ("migration_threshold", "migration_cooldown_s", "migration_failure_backoff_s",
                                  "scaling_cooldown_s", "pd_short_prompt_tokens", "prefix_load_slack",
                                  "shutdown_grace_s"))
        if self.migration_pairing not in PAIRING_NAMES:
            raise ValueError(f"--migration-pairing must be one of {', '.join(PAIRING_NAMES)}, got {self.migration_pairing!r}")
        self.tls.check()
        self.etcd_access.check()
        read_token(self.admin_token, self.admin_token_file, "admin-token")
        try:
            self.scaling.check()
        except InvalidArgument as exc:
            raise ValueError(str(exc).replace("scaling_", "--scaling-").replace("_", "-")) from None
        if self.migration_backend not in _BACKENDS:
            raise ValueError(f"--migration-backend must be empty or one of grpc, gloo, nccl, shm, got {self.migration_backend!r}")

    @property
    def resolved_admin_token(self) -> str:
        """--admin-token, or the contents of --admin-token-file."""
        return read_token(self.admin_token, self.admin_token_file, "admin-token")

    @property
    def migration(self) -> MigrationSettings:
        """The migration settings in force until a policy is stored in etcd."""
        return MigrationSettings(is_enabled=self.migration_enabled, threshold=self.migration_threshold,
                                 selection=self.migration_selection, pairing=self.migration_pairing)

    @property
    def scaling(self) -> ScalingSettings:
        """The scaling settings in force until a policy is stored in etcd."""
        return ScalingSettings(is_enabled=self.scaling_enabled, low_freeness=self.scaling_low_freeness,
                               high_freeness=self.scaling_high_freeness, min_instances=self.scaling_min_instances,
                               max_instances=self.scaling_max_instances)
