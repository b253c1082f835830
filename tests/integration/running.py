"""Service processes started together for a test module and stopped by their PIDs after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from services.cluster.processes import ServiceProcess


@contextlib.contextmanager
def running(*processes: ServiceProcess, timeout_s: float = 90.0) -> Iterator[None]:
    """Start `processes` in order, wait until each is healthy, and stop them all (last first) after."""
    try:
        for process in processes:
            process.start()
        for process in processes:
            asyncio.run(process.wait_healthy(timeout_s))
        yield
    finally:
        for process in reversed(processes):
            process.stop()
