"""Prometheus metrics of a transfer service, served on --metrics-port (0 = off)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

from prometheus_client import Counter, Histogram

from services.common.startup import start_metrics_server

TRANSFERS = Counter("ferry_transfer_transfers_total", "Transfer calls sent from this service, by backend and outcome",
                    ["backend", "outcome"])
TRANSFERRED_BYTES = Counter("ferry_transfer_bytes_total", "KV bytes sent by successful transfers, by backend",
                            ["backend"])
TRANSFER_SECONDS = Histogram("ferry_transfer_duration_seconds", "Duration of successful transfers, by backend",
                             ["backend"], buckets=(1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
IN_PLACE_BYTES = Counter("ferry_transfer_in_place_bytes_total",
                         "KV bytes gloo moved straight from (sent) or into (received) KV memory, with no staging copy",
                         ["side"])
PEER_CLOSES = Counter("ferry_transfer_peer_closes_total",
                      "Channels and peer clients closed because their peer transfer service left etcd or restarted",
                      ["what"])


@contextlib.contextmanager
def observed_transfer(backend: str) -> Iterator[list[int]]:
    """Count one transfer; the caller appends the bytes moved to the yielded list on success."""
    started = time.perf_counter()
    moved: list[int] = []
    try:
        yield moved
    except BaseException:
        TRANSFERS.labels(backend, "failed").inc()
        raise
    TRANSFERS.labels(backend, "ok").inc()
    TRANSFERRED_BYTES.labels(backend).inc(sum(moved))
    TRANSFER_SECONDS.labels(backend).observe(time.perf_counter() - started)


def serve_metrics(port: int, host: str, backends: Sequence[str]) -> None:
    """Serve, with every series at zero from the start (a scrape before the first transfer sees them)."""
    for backend in backends:
        for outcome in ("ok", "failed"):
            TRANSFERS.labels(backend, outcome)
        TRANSFERRED_BYTES.labels(backend)
        TRANSFER_SECONDS.labels(backend)
    for what in ("channel", "client"):
        PEER_CLOSES.labels(what)
    if "gloo" in backends:
        for side in ("sent", "received"):
            IN_PLACE_BYTES.labels(side)
    start_metrics_server(port, host)
