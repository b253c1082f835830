"""The generations a frontend is serving, so a SIGTERM can end them cleanly.

On SIGTERM the frontend stops taking requests and gives those it serves --shutdown-grace-s to
finish. Any still running then are cut the way a client can read: each of its instance
requests is cancelled (the instance frees its KV blocks) and its stream fails with
UNAVAILABLE, so a streaming client gets an SSE error event and `[DONE]`, and a waiting one
a 503 with an OpenAI error body, instead of a connection torn down mid-body.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence

import structlog

from services.common.errors import Unavailable
from services.frontend.req_state import ReqState

log = structlog.get_logger(__name__)

POLL_INTERVAL_S = 0.05


class InFlight:
    def __init__(self) -> None:
        self._running: dict[int, tuple[Sequence[ReqState], Sequence[asyncio.Task]]] = {}
        self._next_key = 0
        self._num_starting = 0  # admitted, not serving yet (tokenizing)
        self._is_past_grace = False

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """An admitted request still preparing (tokenizing its prompt): the shutdown grace waits for it too."""
        self._num_starting += 1
        try:
            yield
        finally:
            self._num_starting -= 1

    @contextlib.contextmanager
    def serving(self, states: Sequence[ReqState], tasks: Sequence[asyncio.Task]) -> Iterator[None]:
        """While the block runs, `states` (fed by `tasks`) count as in flight. Once the shutdown grace
        has passed, a request only now ready to run is refused (a 503) rather than cut mid-body."""
        if self._is_past_grace:
            raise Unavailable("this frontend is shutting down and its grace (--shutdown-grace-s) has passed; "
                              "retry on another one")
        key, self._next_key = self._next_key, self._next_key + 1
        self._running[key] = (states, tasks)
        try:
            yield
        finally:
            del self._running[key]

    async def finish_or_cut(self, grace_s: float) -> int:
        """Wait up to `grace_s` for every generation to end, those still starting included; cut those
        still running. Returns how many were cut."""
        deadline = time.monotonic() + grace_s
        while (self._running or self._num_starting) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_INTERVAL_S)
        self._is_past_grace = True
        running = list(self._running.values())
        for states, tasks in running:
            await _cut(states, tasks, grace_s)
        if running:
            log.warning("requests_cut_by_shutdown", num_requests=len(running), grace_s=grace_s)
        return len(running)


async def _cut(states: Sequence[ReqState], tasks: Sequence[asyncio.Task], grace_s: float) -> None:
    for task in tasks:
        task.cancel()  # cancels its instance stream: the instance aborts the request and frees its blocks
    await asyncio.gather(*tasks, return_exceptions=True)
    for state in states:
        state.fail(Unavailable(f"this frontend is shutting down and the request did not finish within its "
                               f"{grace_s:g} s grace (--shutdown-grace-s), after {state.num_output_tokens} "
                               "tokens; retry on another frontend"))
