"""Read one sample from a service's Prometheus /metrics endpoint."""

from __future__ import annotations

import urllib.request


def sample_value(port: int, sample: str) -> float:
    """The value of `sample` (a metric name with its labels, as exported), 0 if it is absent."""
    return samples(port).get(sample, 0.0)


def samples(port: int) -> dict[str, float]:
    """Every exported sample (a metric name with its labels) → its value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)}
