"""No `*_created` series on any ferry process's /metrics: prometheus_client adds one per counter and
histogram child by default, doubling the series count for timestamps nothing reads. No sockets."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.common import startup
from services.frontend.metrics import FrontendMetrics

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(autouse=True)
def created_on():
    """prometheus_client's default, as a fresh process starts with."""
    prometheus_client.enable_created_metrics()
    yield
    prometheus_client.disable_created_metrics()  # what every ferry process runs with


def test_the_frontend_exports_no_created_series():
    metrics = FrontendMetrics()
    metrics.requests.labels("/v1/completions", "200").inc()
    metrics.time_to_first_token.observe(0.1)
    text = metrics.render().decode()
    assert "ferry_frontend_requests_total{" in text and "_created" not in text


def test_a_service_serving_metrics_on_its_port_exports_no_created_series(monkeypatch):
    """The manager, instances and transfer services serve /metrics through start_metrics_server."""
    monkeypatch.setattr(startup, "start_http_server", lambda port, addr: None)
    registry = CollectorRegistry()
    Counter("ferry_test_total", "a counter", registry=registry).inc()
    Histogram("ferry_test_seconds", "a histogram", registry=registry).observe(1)
    assert "_created" in generate_latest(registry).decode()  # the default this turns off
    startup.start_metrics_server(9100, "127.0.0.1")
    text = generate_latest(registry).decode()
    assert "ferry_test_total 1.0" in text and "_created" not in text
