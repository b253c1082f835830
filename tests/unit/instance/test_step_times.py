"""Engine step times: the medians for load reports (plain, and weighted by each step's tokens), and the
histogram /metrics exports (before, only that median, in milliseconds over the last 256 steps, so no p99
and nothing to aggregate across instances)."""

from __future__ import annotations

from types import SimpleNamespace

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.instance.engine.step_output import StepOutput
from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.metrics import InstanceCollector
from services.instance.runner import EngineRunner
from services.instance.step_times import StepTimes
from tests.integration.metrics_scrape import exposition_problems

pytestmark = pytest.mark.timeout(10)


def test_buckets_are_cumulative_with_inclusive_bounds():
    times = StepTimes(num_recent=2)
    for seconds in (0.004, 0.005, 0.03, 20.0):
        times.add(seconds, 1)
    buckets = dict(times.cumulative_buckets())
    assert (buckets["0.0025"], buckets["0.005"], buckets["0.01"], buckets["0.05"]) == (0, 2, 2, 3)
    assert (buckets["10.0"], buckets["+Inf"]) == (3, 4)
    assert times.sum_s == pytest.approx(20.039)
    assert times.median_ms == pytest.approx((0.03 + 20.0) / 2 * 1000)  # the 2 most recent
    assert StepTimes().median_ms == 0.0


def test_the_token_weighted_median_counts_each_step_once_per_token_it_made():
    """The serving benchmark subtracted the plain median step from the client's median token gap; at load the
    long steps carry the big batches, so the median token waited a longer step than the median step took."""
    times = StepTimes(num_recent=5)
    times.add(9.0, 1)  # (out of the window by the end)
    for seconds, num_tokens in ((0.010, 1), (0.012, 1), (0.030, 6), (0.011, 1), (0.004, 0)):
        times.add(seconds, num_tokens)
    assert times.median_ms == pytest.approx(11.0)
    assert times.token_weighted_median_ms == pytest.approx(30.0)  # 6 of the 9 tokens came from the 30 ms step
    assert StepTimes().token_weighted_median_ms == 0.0


def test_the_token_weighted_median_is_the_plain_one_when_each_step_makes_as_many_tokens():
    times = StepTimes()
    for seconds in (0.040, 0.010, 0.030, 0.020):
        times.add(seconds, 3)
    assert times.token_weighted_median_ms == pytest.approx(times.median_ms) == pytest.approx(25.0)
    only_idle = StepTimes()
    only_idle.add(0.5, 0)  # a prefill chunk that made no token yet
    assert only_idle.token_weighted_median_ms == 0.0 and only_idle.median_ms == pytest.approx(500.0)


def test_instance_exports_the_step_histogram():
    times = StepTimes()
    for seconds in (0.02, 0.07, 0.07):
        times.add(seconds, 1)
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


class ScriptedSteps:
    """An engine whose steps take the scripted seconds and make the scripted outputs."""

    def __init__(self, *steps: tuple[float, list[StepOutput]]) -> None:
        self.steps = list(steps)
        self.last_step_was_idle = False
        self.scheduler = SimpleNamespace(suspended=[])

    def load(self) -> tuple[int, ...]:
        return ()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0)

    def step(self) -> list[StepOutput]:
        seconds, outputs = self.steps.pop(0)
        time.sleep(seconds)
        return outputs


def tokens(num_requests: int, num_tokens: int) -> list[StepOutput]:
    return [StepOutput(f"r-{n}", 1, (7,) * num_tokens, "", None, None, 3) for n in range(num_requests)]


async def test_each_engine_step_counts_the_tokens_its_outputs_carry():
    """A long step of a batch of 4 and a short one of 1: the load report's weighted median is the long step's."""
    runner = EngineRunner(ScriptedSteps((0.05, tokens(4, 1)), (0.0, tokens(1, 1)), (0.0, tokens(1, 0))),
                          asyncio.get_running_loop())
    for _ in range(3):
        assert runner._step()
    assert runner.num_steps == 3
    assert runner.step_time_ms_token_weighted_p50 >= 50 > runner.step_time_ms_p50


class FinishingStep(ScriptedSteps):
    """One step that finishes the one request running: its load changes with the step."""

    def __init__(self) -> None:
        super().__init__((0.0, [StepOutput("r-0", 1, (7,), "", "stop", None, 3)]))
        self.num_running = 1

    def load(self) -> tuple[int, ...]:
        return (self.num_running,)

    def step(self) -> list[StepOutput]:
        self.num_running = 0
        return super().step()


async def test_a_steps_load_is_taken_before_its_outputs_go_out():
    """The load was taken after the outputs were handed to the event loop: a client that got a request's last
    token and asked GetStatus at once could still see it running (test_instance_service flaked so, under load)."""
    seen_at_publish = []

    class Runner(EngineRunner):
        def _publish(self, outputs, held):
            seen_at_publish.append(self.load)
            super()._publish(outputs, held)

    runner = Runner(FinishingStep(), asyncio.get_running_loop())
    assert runner.load == (1,)
    assert runner._step()
    assert seen_at_publish == [(0,)]
