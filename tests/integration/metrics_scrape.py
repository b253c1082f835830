"""Read one sample from a service's Prometheus /metrics endpoint."""

from __future__ import annotations

import urllib.request


def sample_value(port: int, sample: str) -> float:
    """The value of `sample` (a metric name with its labels, as exported), 0 if it is absent."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " ")), 0.0)
