"""Takes the instance out of service while one engine step runs far too long.

A hung accelerator or a deadlock in a step leaves the process alive: gRPC still answers
pings and health checks, so neither keepalive nor a dead socket reveals it, and its
clients would wait on it until their deadline. The engine runs on its own thread, so the
event loop can watch it. Once a step has run longer than `--engine-stall-timeout-s`:

* every request stream ends with UNAVAILABLE (frontends resume those requests on other
  instances from the tokens they have), and the requests are aborted on the engine; the
  aborts run as soon as the step returns;
* the instance takes no new work (Generate and PrepareMigrateIn answer UNAVAILABLE),
  reports NOT_SERVING to health checks, and sends no load reports, so the manager marks
  it UNHEALTHY within `--report-timeout-s` and dispatches nothing to it.

When the step returns, the instance serves again (unless it is shutting down meanwhile).
Set the timeout well above the longest step the deployment ever runs (a full
`--max-num-batched-tokens` prefill chunk); 0 turns the stall timeout off.

An engine whose step raised (the runner is then broken: its streams ended with INTERNAL, it
never steps again) is taken out of service the same way, whatever the timeout, and the
instance then shuts down and exits 1, so its supervisor (the launcher, systemd) starts it
again: before, it still said SERVING, reported its dead requests as running and took
migrations in whose commits then failed, for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from services.common.errors import Unavailable
from services.instance.runner import EngineRunner

log = structlog.get_logger(__name__)

SetServing = Callable[[bool], Awaitable[None]]


class StallWatchdog:
    def __init__(self, runner: EngineRunner, timeout_s: float, set_serving: SetServing,
                 is_shutting_down: Callable[[], bool], on_broken: Callable[[], None] = lambda: None) -> None:
        self._runner = runner
        self._timeout_s = timeout_s
        self._set_serving = set_serving
        self._is_shutting_down = is_shutting_down
        self._on_broken = on_broken  # the app: shut down and exit with a failure, so a supervisor restarts it
        self.is_stalled = False

    async def watch_loop(self) -> None:
        interval_s = min(1.0, self._timeout_s / 4) if self._timeout_s > 0 else 1.0
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 — a failed check must not end the watch (or the instance)
                log.exception("stall_check_failed")

    async def check(self) -> None:
        if self._runner.is_broken:
            if not self.is_stalled:
                self.is_stalled = True  # for good: a broken engine never steps again
                log.error("engine_broken", action="this instance stops serving and exits with a failure")
                await self._set_serving(False)
                self._on_broken()
            return
        if self._timeout_s <= 0:
            return
        running_for_s = self._runner.step_running_for_s
        if not self.is_stalled and running_for_s > self._timeout_s:
            await self._stall(running_for_s)
        elif self.is_stalled and running_for_s <= self._timeout_s:
            await self._recover()

    async def _stall(self, running_for_s: float) -> None:
        self.is_stalled = True
        num_requests = self._runner.abandon_all(Unavailable(
            f"the engine step has run for {running_for_s:.1f} s (--engine-stall-timeout-s {self._timeout_s:g}); "
            "this instance stopped serving until it returns: resume the request elsewhere"))
        log.error("engine_stalled", step_running_for_s=round(running_for_s, 1), num_requests_failed=num_requests)
        await self._set_serving(False)

    async def _recover(self) -> None:
        self.is_stalled = False
        log.warning("engine_recovered")
        if not self._is_shutting_down():
            await self._set_serving(True)
