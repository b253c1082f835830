"""Prometheus metrics of the manager, served on --metrics-port."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from services.common.membership import MembershipView
from services.common.startup import start_metrics_server
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceState, Role
from services.manager.leadership import Leadership
from services.manager.migration import MigrationOutcome, MigrationTrigger

DISPATCHES = Counter("ferry_manager_dispatches_total", "Requests dispatched, by policy", ["policy"])
DISPATCH_REFUSALS = Counter("ferry_manager_dispatch_refusals_total",
                            "Dispatch calls answered with an error (not the leader, nothing serving)")
DISPATCH_LATENCY = Histogram("ferry_manager_dispatch_latency_seconds", "Time to choose an instance, in the handler",
                             buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2))
LOAD_REPORTS = Counter("ferry_manager_load_reports_total", "Load reports received from instances")
IS_LEADER = Gauge("ferry_manager_is_leader", "1 while this manager is the elected leader, else 0")
MIGRATIONS = Counter("ferry_manager_migrations_total", "Live migrations attempted, by outcome and trigger",
                     ["outcome", "trigger"])
MIGRATION_FAILURES = Counter("ferry_manager_migration_failures_total",
                             "Live migrations that failed (a fault; not those refused for want of room), by the gRPC status of MigrateOut",
                             ["reason"])
MIGRATIONS_SOURCE_BUSY = Counter("ferry_manager_migrations_source_busy_total",
                                 "MigrateOut calls their source refused at once, its own migration slots "
                                 "(--max-concurrent-migrations) busy: nothing tried, no failed migration", ["trigger"])
MIGRATIONS_ADOPTED = Counter("ferry_manager_migrations_adopted_total",
                             "Migrations an earlier leader's term left unknown that this leader looked into, by what "
                             "they turned out to be (unknown: still not found out); not in migrations_total, which "
                             "the earlier leader counted them in", ["outcome"])
SCALING_ACTIONS = Counter("ferry_manager_scaling_actions_total",
                          "Scaling decisions the leader wrote to scaling/target, by action (add, retire, cancel_retire)", ["action"])
MIGRATED_BYTES = Counter("ferry_manager_migrated_bytes_total", "KV cache bytes moved by committed migrations")
MIGRATED_BLOCKS = Counter("ferry_manager_migrated_blocks_total", "KV cache blocks moved by committed migrations")
MIGRATION_DOWNTIME = Histogram("ferry_manager_migration_downtime_seconds",
                               "Request paused on the source -> committed on the destination (committed migrations)",
                               buckets=(1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
MIGRATION_DURATION = Histogram("ferry_manager_migration_duration_seconds", "MigrateOut from call to commit",
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
MEMBERSHIP_STALENESS = Gauge("ferry_manager_membership_staleness_seconds",
                             "Seconds since etcd last confirmed the manager's view of instances/ (grows while etcd "
                             "is unreachable; the last known members are kept)")
PD_ROLE_FALLBACKS = Counter("ferry_manager_pd_role_fallbacks_total",
                            "Requests that did without a PD role: 'prefill' = a new request sent to a decode "
                            "instance (none prefills), 'decode' = a prefilled request kept on its prefill instance",
                            ["role"])
MIGRATIONS_IN_FLIGHT = Gauge("ferry_manager_migrations_in_flight", "MigrateOut calls not answered yet")


def serve_metrics(port: int, host: str, view: ClusterView, leadership: Leadership,
                  is_role_missing: Callable[[Role], bool]) -> None:
    """Start the /metrics HTTP server on `host` (--host, as the gRPC server; a daemon thread);
    gauges read the view (and the dispatcher's role gaps, `RoleGaps.is_missing`) when scraped."""
    IS_LEADER.set_function(lambda: float(leadership.is_leader))
    REGISTRY.register(InstanceLoadCollector(view, leadership))
    REGISTRY.register(RoleGapCollector(is_role_missing, leadership))
    export_zero_series()
    start_metrics_server(port, host)


def export_zero_series() -> None:
    """Every series of a known label set, at zero from the start: a rate() or an alert on
    failed migrations has a series (0) before the first migration, as a dashboard has a line."""
    for outcome in MigrationOutcome:
        for trigger in MigrationTrigger:
            MIGRATIONS.labels(outcome.value, trigger.value)
    for trigger in MigrationTrigger:
        MIGRATIONS_SOURCE_BUSY.labels(trigger.value)
    for outcome in MigrationOutcome:  # adoption asks the destination: never a refusal
        if outcome is not MigrationOutcome.REFUSED:
            MIGRATIONS_ADOPTED.labels(outcome.value)
    for action in ("add", "retire", "cancel_retire"):
        SCALING_ACTIONS.labels(action)


def watch_membership_staleness(members: MembershipView) -> None:
    """Read the instances/ view's staleness at every scrape."""
    MEMBERSHIP_STALENESS.set_function(lambda: members.staleness_s)


class InstanceLoadCollector:
    """Instances by state and per-instance load gauges, read from the cluster view at scrape
    time (no stale labels). Only the leader's view has load reports: a standby's shows every
    instance UNHEALTHY with its cache free, so a standby exports the families without samples
    (a `max by` across managers, as the Grafana dashboard does, then reads the leader alone)."""

    _FIELDS = (
        ("ferry_manager_instance_running", "Requests running on the instance", lambda load: load.num_running),
        ("ferry_manager_instance_waiting", "Requests queued on the instance", lambda load: load.num_waiting),
        ("ferry_manager_instance_free_blocks", "Free KV blocks on the instance", lambda load: load.num_free_blocks),
        ("ferry_manager_instance_total_blocks", "KV blocks of the instance", lambda load: load.num_total_blocks),
        ("ferry_manager_instance_freeness", "(free - needed by queued - priority headroom) blocks / (running + 1)", lambda load: load.freeness),
        ("ferry_manager_instance_free_slots", "Batch slots free on the instance (no sample until it reports them)",
         lambda load: load.num_free_slots),
    )

    def __init__(self, view: ClusterView, leadership: Leadership) -> None:
        self._view = view
        self._leadership = leadership

    def collect(self):
        is_leader = self._leadership.is_leader
        states = GaugeMetricFamily("ferry_manager_instances", "Registered instances, by state (the leader only)",
                                   labels=["state"])
        for state in InstanceState if is_leader else ():
            states.add_metric([state.value], float(_count(self._view, state)))
        yield states
        instances = _instances(self._view) if is_leader else []
        for name, help_text, read in self._FIELDS:
            family = GaugeMetricFamily(name, help_text, labels=["instance_id"])
            for instance in instances:
                value = read(instance.load)
                if value is not None:  # not reported (an older instance): no sample rather than a made-up 0
                    family.add_metric([instance.record.instance_id], float(value))
            yield family


class RoleGapCollector:
    """ferry_manager_pd_role_missing{role}: 1 while no instance of the role serves, read from the
    dispatcher's role gaps at scrape time. Only the leader dispatches, so only it knows: a standby (an
    ex-leader too) exports the family without samples, as InstanceLoadCollector does. Before, a Gauge
    set by the dispatch path kept an ex-leader's last gap at 1 for good."""

    _ROLES = (Role.PREFILL, Role.DECODE)

    def __init__(self, is_missing: Callable[[Role], bool], leadership: Leadership) -> None:
        self._is_missing = is_missing
        self._leadership = leadership

    def collect(self):
        family = GaugeMetricFamily("ferry_manager_pd_role_missing",
                                   "1 while no instance of the role serves (PD disaggregation; the leader only)",
                                   labels=["role"])
        for role in self._ROLES if self._leadership.is_leader else ():
            family.add_metric([role.value], float(self._is_missing(role)))
        yield family


def _count(view: ClusterView, state: InstanceState) -> int:
    # Scrapes run on the HTTP thread; the view is read without a lock. Each read is a
    # snapshot of one dict, good enough for a gauge; a concurrent change just retries.
    for _ in range(3):
        try:
            return sum(view.state_of(instance_id) is state for instance_id in view.member_ids())
        except (KeyError, RuntimeError):
            continue
    return 0


def _instances(view: ClusterView) -> list:
    """The view's instances, read from the HTTP thread (retried like `_count`)."""
    for _ in range(3):
        try:
            return view.instances()
        except (KeyError, RuntimeError):
            continue
    return []
