"""Prometheus metrics of one instance, served on --metrics-port (0 = off).

Everything is read from the runner at scrape time (load and KV figures, requests served,
engine steps, step times and preemptions), so the engine thread does no metrics work beyond
adding each step's time to `runner.step_times`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from services.common.startup import start_metrics_server
from services.instance.runner import EngineRunner


class InstanceCollector:
    def __init__(self, runner: EngineRunner, instance_id: str, num_quarantined: Callable[[], int] = lambda: 0) -> None:
        self._runner = runner
        self._instance_id = instance_id
        self._num_quarantined = num_quarantined

    def collect(self):
        runner, load = self._runner, self._runner.load
        gauges = (
            ("ferry_instance_running_requests", "Requests in the running batch", load.num_running),
            ("ferry_instance_waiting_requests", "Requests queued for admission", load.num_waiting),
            ("ferry_instance_free_blocks", "Free KV cache blocks", load.num_free_blocks),
            ("ferry_instance_total_blocks", "KV cache blocks", load.num_total_blocks),
            ("ferry_instance_freeness", "(free - needed by queued - priority headroom) blocks / (running + 1)",
             load.freeness),
            ("ferry_instance_free_slots", "Batch slots (--max-num-seqs) no running, migrating, reserved or queued "
             "request will take", load.num_free_slots),
            ("ferry_instance_step_time_ms_p50", "Median engine step time over the last 256 steps",
             runner.step_time_ms_p50),
            ("ferry_instance_open_streams", "Requests with an open output stream", runner.num_active),
            ("ferry_instance_prefix_cache_hit_rate", "Share of admitted context tokens found in the prefix cache",
             runner.prefix_cache_stats.hit_rate),
            ("ferry_instance_quarantined_reservations",
             "Given-up incoming migrations whose blocks wait until the transfer service confirms no copy can still "
             "write into them", self._num_quarantined()),
        )
        for name, help_text, value in gauges:
            yield self._family(GaugeMetricFamily, name, help_text, value)
        yield self._family(CounterMetricFamily, "ferry_instance_requests_served", "Requests that finished here",
                           runner.num_requests_served)
        yield self._family(CounterMetricFamily, "ferry_instance_engine_steps", "Engine steps run", runner.num_steps)
        yield self._family(CounterMetricFamily, "ferry_instance_preemptions",
                           "Running requests sent back to the queue to free KV blocks (recomputed when readmitted)",
                           runner.num_preemptions)
        yield self._family(CounterMetricFamily, "ferry_instance_grammar_dead_ends",
                           "Constrained requests stopped (finish reason stop) where their grammar allowed no token of "
                           "the vocabulary: the answer is cut short of what the grammar describes",
                           runner.num_grammar_dead_ends)
        steps = HistogramMetricFamily("ferry_instance_step_duration_seconds", "Engine steps by how long they took",
                                      labels=["instance_id"])
        steps.add_metric([self._instance_id], runner.step_times.cumulative_buckets(), runner.step_times.sum_s)
        yield steps
        stats = runner.prefix_cache_stats
        yield self._family(CounterMetricFamily, "ferry_instance_prefix_cache_queried_tokens",
                           "Context tokens of admitted requests (the most the prefix cache could serve)",
                           stats.num_queried_tokens)
        yield self._family(CounterMetricFamily, "ferry_instance_prefix_cache_hit_tokens",
                           "Context tokens whose K/V came from the prefix cache", stats.num_hit_tokens)

    def _family(self, kind, name: str, help_text: str, value: float):
        family = kind(name, help_text, labels=["instance_id"])
        family.add_metric([self._instance_id], float(value))
        return family


def serve_metrics(port: int, host: str, runner: EngineRunner, instance_id: str,
                  num_quarantined: Callable[[], int] = lambda: 0) -> None:
    """Start the /metrics HTTP server on a daemon thread."""
    REGISTRY.register(InstanceCollector(runner, instance_id, num_quarantined))
    start_metrics_server(port, host)
