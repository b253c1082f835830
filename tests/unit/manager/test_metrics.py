"""The manager's view gauges: only the leader, whose view has the load reports, exports them."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from services.common.errors import Unavailable
from services.manager.dispatcher import Dispatcher
from services.manager.leadership import Leadership
from services.manager.metrics import InstanceLoadCollector, RoleGapCollector, export_zero_series
from tests.unit.manager.factories import make_view

pytestmark = pytest.mark.timeout(10)


def scrape(is_leader: bool) -> str:
    leadership = Leadership("m-1", "127.0.0.1:50051")
    leadership.set_elected(is_leader)
    registry = CollectorRegistry()
    registry.register(InstanceLoadCollector(make_view("a", "b", num_free_blocks=400, num_running=2, num_free_slots=3), leadership))
    return generate_latest(registry).decode()


def test_leader_exports_states_and_load_per_instance():
    text = scrape(is_leader=True)
    assert 'ferry_manager_instances{state="serving"} 2.0' in text
    assert 'ferry_manager_instances{state="unhealthy"} 0.0' in text
    assert 'ferry_manager_instance_free_blocks{instance_id="a"} 400.0' in text
    assert 'ferry_manager_instance_running{instance_id="b"} 2.0' in text
    assert 'ferry_manager_instance_free_slots{instance_id="a"} 3.0' in text


def test_an_instance_that_reports_no_free_slots_has_no_free_slots_sample():
    """An older instance does not report them: no sample, not a 0 that reads as a full batch."""
    leadership = Leadership("m-1", "127.0.0.1:50051")
    leadership.set_elected(True)
    registry = CollectorRegistry()
    registry.register(InstanceLoadCollector(make_view("a", num_free_slots=None), leadership))
    text = generate_latest(registry).decode()
    assert "# TYPE ferry_manager_instance_free_slots gauge" in text
    assert "ferry_manager_instance_free_slots{" not in text
    assert 'ferry_manager_instance_running{instance_id="a"} 0.0' in text


def test_standby_exports_the_families_without_samples():
    """A standby's view has no load reports: it would say every instance is UNHEALTHY with its
    whole cache free, and the dashboard's max across managers would show that beside the leader."""
    text = scrape(is_leader=False)
    assert "# TYPE ferry_manager_instances gauge" in text
    assert "# TYPE ferry_manager_instance_free_blocks gauge" in text
    assert not [line for line in text.splitlines() if line and not line.startswith("#")]


def test_migration_and_scaling_counters_start_at_zero():
    """Before, ferry_manager_migrations_total had no series until the first migration: a panel
    or an alert on failed drains read "no data" rather than 0."""
    export_zero_series()
    text = generate_latest(REGISTRY).decode()
    for outcome in ("committed", "failed", "refused", "unknown"):
        for trigger in ("load", "drain", "admin", "pd"):
            assert f'ferry_manager_migrations_total{{outcome="{outcome}",trigger="{trigger}"}}' in text
    assert 'ferry_manager_scaling_actions_total{action="retire"}' in text
    assert 'ferry_manager_migrations_adopted_total{outcome="unknown"}' in text
    assert 'ferry_manager_migrations_adopted_total{outcome="refused"}' not in text  # adoption never learns of one


def scrape_role_gaps(leadership: Leadership, dispatcher: Dispatcher) -> str:
    registry = CollectorRegistry()
    registry.register(RoleGapCollector(dispatcher.role_gaps.is_missing, leadership))
    return generate_latest(registry).decode()


def test_an_ex_leader_exports_no_role_gap():
    """ferry_manager_pd_role_missing is leader-only like the instance gauges. Before, a Gauge set on the
    dispatch path stayed at 1 on a manager that lost its leadership with a gap open, so `max` across
    managers showed a missing role for good, whatever the new leader saw."""
    leadership = Leadership("m-1", "127.0.0.1:50051")
    leadership.set_elected(True)
    view = make_view("a")  # a BOTH instance: nothing decodes a prefilled request elsewhere
    dispatcher = Dispatcher(view, leadership)
    with pytest.raises(Unavailable):
        dispatcher.place_decode("r", "a", num_blocks=1)
    text = scrape_role_gaps(leadership, dispatcher)
    assert 'ferry_manager_pd_role_missing{role="decode"} 1.0' in text
    assert 'ferry_manager_pd_role_missing{role="prefill"} 0.0' in text
    leadership.set_elected(False)  # lost the election, the gap still noted
    text = scrape_role_gaps(leadership, dispatcher)
    assert "# TYPE ferry_manager_pd_role_missing gauge" in text
    assert not [line for line in text.splitlines() if line and not line.startswith("#")]
