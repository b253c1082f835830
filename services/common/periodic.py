"""`periodic_loop`: the shape of a background loop that does one step every interval, forever.

A background loop runs as long as its process. One step that raises (a peer answering
INTERNAL, an etcd error nobody expected, a race in our own state) must not end it, and
inside a `TaskGroup` must not take the process down with it: the step's error is logged
and the next step runs. Repeated failures stretch the wait (`Backoff`), so a step that
always fails logs a traceback every few seconds, not every interval. Cancelling the loop
stops it at once (`CancelledError` is never caught).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from services.common.backoff import Backoff

log = structlog.get_logger(__name__)

MAX_FAILURE_DELAY_S = 10.0  # longest extra wait after failed steps in a row


async def periodic_loop(name: str, interval_s: float | Callable[[], float],
                        step: Callable[[], Awaitable[object]]) -> None:
    """Sleep `interval_s` (or what it returns now, if callable), then `await step()`; again until
    cancelled. `name` labels the failures logged."""
    backoff = Backoff(initial_s=0.1, max_s=MAX_FAILURE_DELAY_S)
    while True:
        await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)
        try:
            await step()
            backoff.reset()
        except Exception:  # noqa: BLE001 — one failed step must not end the loop (or the process)
            log.exception("periodic_step_failed", loop=name, num_failures=backoff.num_attempts + 1)
            await backoff.sleep()
