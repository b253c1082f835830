"""Prometheus metrics of the manager, served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceState
from services.manager.leadership import Leadership

DISPATCHES = Counter("ferry_manager_dispatches_total", "Requests dispatched, by policy", ["policy"])
DISPATCH_REFUSALS = Counter("ferry_manager_dispatch_refusals_total",
                            "Dispatch calls answered with an error (not the leader, nothing serving)")
DISPATCH_LATENCY = Histogram("ferry_manager_dispatch_latency_seconds", "Time to choose an instance, in the handler",
                             buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2))
LOAD_REPORTS = Counter("ferry_manager_load_reports_total", "Load reports received from instances")
IS_LEADER = Gauge("ferry_manager_is_leader", "1 while this manager is the elected leader, else 0")
INSTANCES = Gauge("ferry_manager_instances", "Registered instances, by state", ["state"])


def serve_metrics(port: int, view: ClusterView, leadership: Leadership) -> None:
    """Start the /metrics HTTP server (a daemon thread); gauges read the view when scraped."""
    IS_LEADER.set_function(lambda: float(leadership.is_leader))
    for state in InstanceState:
        INSTANCES.labels(state.value).set_function(lambda state=state: float(_count(view, state)))
    start_http_server(port)


def _count(view: ClusterView, state: InstanceState) -> int:
    # Scrapes run on the HTTP thread; the view is read without a lock. Each read is a
    # snapshot of one dict, good enough for a gauge; a concurrent change just retries.
    for _ in range(3):
        try:
            return sum(view.state_of(instance_id) is state for instance_id in view.member_ids())
        except (KeyError, RuntimeError):
            continue
    return 0
