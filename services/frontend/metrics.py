"""Prometheus metrics of the frontend, served on GET /metrics of its HTTP port.

One `FrontendMetrics` per process, with its own registry (so tests can make several).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.startup import drop_created_series

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        drop_created_series()
        self.registry = CollectorRegistry()
        self.requests = Counter("ferry_frontend_requests_total", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "ferry_frontend_time_to_first_token_seconds", "From the request's arrival to its first output token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "ferry_frontend_inter_token_latency_seconds", "Between consecutive output tokens of a request",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(
            "ferry_frontend_prompt_tokens_total",
            "Prompt tokens of the generation requests admitted (each prompt once, whatever its n)",
            registry=self.registry)
        self.generation_tokens = Counter(
            "ferry_frontend_generation_tokens_total",
            "Output tokens streamed back from the instances, every choice's, counted as they arrive",
            registry=self.registry)
        self.in_flight = Gauge("ferry_frontend_requests_in_flight", "--max-inflight slots taken: choices of generations, "
                               "/tokenize or /detokenize calls being served and bodies being read",
                               registry=self.registry)
        self.dispatch_fallbacks = Counter(
            "ferry_frontend_dispatch_fallbacks_total",
            "Requests placed by the frontend itself because no manager answered Dispatch in time",
            registry=self.registry)
        self.dispatch_role_fallbacks = Counter(
            "ferry_frontend_dispatch_role_fallbacks_total",
            "Requests the frontend itself placed on a decode instance because no prefill-capable instance serves",
            registry=self.registry)
        self.constrained = Counter(
            "ferry_frontend_constrained_requests_total",
            "Requests decoded under a grammar, by the field that asked for it (response_format, guided_json, "
            "structured_outputs, ..., tool_choice for forced tool calls)", ["field"], registry=self.registry)
        self.stream_errors = Counter(
            "ferry_frontend_stream_errors_total",
            "Streams ended by an error event after their 200, by the HTTP status the error would have had "
            "(ferry_frontend_requests_total counts them as 200)", ["status"], registry=self.registry)
        self.resumes = Counter("ferry_frontend_stream_resumes_total",
                               "Requests re-dispatched after their instance's stream broke", registry=self.registry)
        self.handoffs = Counter("ferry_frontend_stream_handoffs_total",
                                "Streams continued on another instance after a live migration (Attach)",
                                registry=self.registry)
        self.membership_staleness = Gauge(
            "ferry_frontend_membership_staleness_seconds",
            "Seconds since etcd last confirmed the frontend's view of the instances (grows while etcd is "
            "unreachable; the last known instances keep being used)", registry=self.registry)

    def watch_staleness(self, staleness_s: Callable[[], float]) -> None:
        """Read the membership view's staleness at every scrape."""
        self.membership_staleness.set_function(staleness_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_tokens(self, arrived_at: float, last_token_at: float | None, now: float, num_tokens: int) -> None:
        """Record a delta of `num_tokens` tokens arriving at `now` (all but the first count as one gap each)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if last_token_at is None:
            self.time_to_first_token.observe(now - arrived_at)
            num_gaps, since = num_tokens - 1, now
        else:
            num_gaps, since = num_tokens, last_token_at
        if num_gaps:
            gap = (now - since) / num_gaps
            for _ in range(num_gaps):
                self.inter_token_latency.observe(gap)
