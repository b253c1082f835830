"""Engine step times: the median for load reports, and the histogram /metrics exports
(before, only that median, in milliseconds over the last 256 steps, so no p99 and nothing
to aggregate across instances)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.instance.metrics import InstanceCollector
from services.instance.step_times import StepTimes
from tests.integration.metrics_scrape import exposition_problems

pytestmark = pytest.mark.timeout(10)


def test_buckets_are_cumulative_with_inclusive_bounds():
    times = StepTimes(num_recent=2)
    for seconds in (0.004, 0.005, 0.03, 20.0):
        times.add(seconds)
    buckets = dict(times.cumulative_buckets())
    assert (buckets["0.0025"], buckets["0.005"], buckets["0.01"], buckets["0.05"]) == (0, 2, 2, 3)
    assert (buckets["10.0"], buckets["+Inf"]) == (3, 4)
    assert times.sum_s == pytest.approx(20.039)
    assert times.median_ms == pytest.approx((0.03 + 20.0) / 2 * 1000)  # the 2 most recent
    assert StepTimes().median_ms == 0.0


def test_instance_exports_the_step_histogram():
    times = StepTimes()
    for seconds in (0.02, 0.07, 0.07):
        times.add(seconds)
    load = SimpleNamespace(num_running=1, num_waiting=0, num_free_blocks=10, num_total_blocks=12, freeness=5.0,
                           num_free_slots=3)
    stats = SimpleNamespace(hit_rate=0.0, num_queried_tokens=0, num_hit_tokens=0)
    runner = SimpleNamespace(load=load, step_time_ms_p50=times.median_ms, num_active=1, prefix_cache_stats=stats,
                             num_requests_served=0, num_steps=3, num_preemptions=0, num_grammar_dead_ends=0,
                             step_times=times)
    registry = CollectorRegistry()
    registry.register(InstanceCollector(runner, "i-0"))
    text = generate_latest(registry).decode()
    assert not exposition_problems(text)
    assert 'ferry_instance_free_slots{instance_id="i-0"} 3.0' in text
    assert 'ferry_instance_step_duration_seconds_bucket{instance_id="i-0",le="0.025"} 1.0' in text
    assert 'ferry_instance_step_duration_seconds_bucket{instance_id="i-0",le="0.1"} 3.0' in text
    assert 'ferry_instance_step_duration_seconds_count{instance_id="i-0"} 3.0' in text
