"""Runs the engine on its own thread so the event loop never blocks.

Design: the engine (`LLMEngine`) is plain, single-threaded logic. `EngineThread` owns it on
one thread whose loop reads aloud:

    run queued commands  →  step if there is work  →  snapshot load  →  publish outputs

The load is taken before the outputs go out, so a client that got a request's last token and then
asks for the instance's status (GetStatus, a load report) sees that request gone.

Commands (add, abort, list) are closures queued from the event loop; their results come
back as asyncio futures. A step's outputs go to the event loop with
`loop.call_soon_threadsafe`, to `_deliver` (EngineRunner: one stream per request), so the
gRPC side only ever awaits.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_reports import LoadSnapshot
from services.instance.engine.step_output import StepOutput
from services.instance.engine.migration_state import HeldRequest
from services.instance.step_times import StepTimes

log = structlog.get_logger(__name__)

_IDLE_WAIT_S = 0.05


class EngineThread:
    """The engine on its thread: commands, steps, load snapshots. A subclass takes each step's outputs
    (`_deliver`) and a failed step (`_fail_all`) on the event loop."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        # (load, requests suspended): replaced whole after every step and command; readers never see a torn
        # value, nor a request suspended or resumed in between counted in neither figure.
        self._snapshot: tuple[LoadSnapshot, int] = (engine.load(), _num_suspended(engine))
        self.prefix_cache_stats = engine.prefix_cache_stats()  # the same, for metrics
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._num_publishes = 0  # steps' outputs sent to the event loop so far (engine thread only)
        self.step_times = StepTimes()  # the engine thread adds each step's; /metrics and load reports read them
        self.num_steps = 0
        self.is_broken = False  # set when a step raised; the instance then refuses new work
        self._step_started_at: float | None = None  # monotonic, while a step runs (engine thread writes it)
        self.on_load_change: Callable[[LoadSnapshot], None] | None = None
        self.holds_first_tokens: Callable[[], bool] = lambda: False  # read on the engine thread

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Whether the engine thread ended within `timeout_s` (a step it runs ends first)."""
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def engine(self) -> LLMEngine:
        """The engine; touch it only inside `call()`, which runs on the engine thread."""
        return self._engine

    @property
    def load(self) -> LoadSnapshot:
        return self._snapshot[0]

    @property
    def load_and_suspended(self) -> tuple[LoadSnapshot, int]:
        """The load and, of the same moment, the requests out of the batch that it counts neither running nor
        waiting: parked for their PD hand-off, or suspended for a migration's last stage."""
        return self._snapshot

    @property
    def step_time_ms_p50(self) -> float:
        """Median engine step time over the recent steps (0 before the first step)."""
        return self.step_times.median_ms

    @property
    def step_time_ms_token_weighted_p50(self) -> float:
        """The same steps' median weighted by the tokens each produced (0 before a step made a token)."""
        return self.step_times.token_weighted_median_ms

    @property
    def num_preemptions(self) -> int:
        """Requests sent back to the queue to free KV blocks since start (an int the engine thread bumps)."""
        return self._engine.scheduler.num_preemptions

    @property
    def num_grammar_dead_ends(self) -> int:
        """Constrained requests stopped where their grammar allowed no token (an int the engine thread bumps)."""
        return self._engine.num_grammar_dead_ends

    @property
    def step_running_for_s(self) -> float:
        """How long the engine has been inside its current step (0 between steps)."""
        started = self._step_started_at
        return 0.0 if started is None else time.monotonic() - started

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the engine thread before the next step, without waiting (its errors are logged)."""
        def run() -> None:
            try:
                fn()
            finally:
                self._snapshot_load_logged()

        self._submit(run)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return its result."""
        future: asyncio.Future[Any] = self._loop.create_future()

        def run() -> None:
            try:
                outcome = fn(), None
            except BaseException as exc:  # handed back to the awaiting coroutine
                outcome = None, exc
            # Commands move blocks too (aborts, migrations): load is current on return. A snapshot that fails
            # is logged, not handed back: the command itself did what it did.
            self._snapshot_load_logged()
            self._loop.call_soon_threadsafe(_settle, future, *outcome)

        self._submit(run)
        return await future

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _engine_loop(self) -> None:
        # Invariant: only this thread touches self._engine. After a failed step the
        # loop keeps running commands (so no caller of `call()` waits forever) but
        # never steps again.
        while not self._stopping.is_set():
            self._run_commands()
            if self.is_broken or not self._engine.has_unfinished() or not self._step():
                self._wakeup.wait(_IDLE_WAIT_S)  # a command (a new request, an abort, a freed reservation) wakes us
                self._wakeup.clear()
                self._snapshot_load_logged()  # (a step took its own, before its outputs went out)

    def _step(self) -> bool:
        """One engine step; False if it had nothing to run (then it counts as no step)."""
        started = time.perf_counter()
        self._step_started_at = time.monotonic()
        try:
            outputs = self._engine.step()
            held = self._hold_first_tokens(outputs)
        except Exception as exc:  # a broken engine must fail its clients, not hang them
            log.exception("engine_step_failed")
            self.is_broken = True
            self._loop.call_soon_threadsafe(self._fail_all, exc)
            return True
        finally:
            self._step_started_at = None
        if self._engine.last_step_was_idle:
            return False
        self.step_times.add(time.perf_counter() - started, sum(len(o.new_token_ids) for o in outputs))
        self.num_steps += 1
        self._snapshot_load_logged()
        self._publish(outputs, held)
        return True

    def _hold_first_tokens(self, outputs: list[StepOutput]) -> dict[str, HeldRequest]:
        """PD push: park each request that got its first token in this step before the next
        step starts, so it decodes no token here and its hand-off needs no engine call."""
        if not outputs or not self.holds_first_tokens():
            return {}
        held = {}
        for output in outputs:
            if output.token_index == 0 and output.new_token_ids and output.finish_reason is None:
                request = self._engine.hold_and_export(output.request_id)
                if request is not None:
                    held[output.request_id] = request
        return held

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # noqa: BLE001 — the engine thread outlives any one command (call() hands errors back)
                log.exception("engine_command_failed")

    def _snapshot_load_logged(self) -> None:
        try:
            self._snapshot_load()
        except Exception:  # noqa: BLE001 — a load figure is not worth the engine thread, nor a command's result
            log.exception("load_snapshot_failed")

    def _snapshot_load(self) -> None:
        self.prefix_cache_stats = self._engine.prefix_cache_stats()
        snapshot = (self._engine.load(), _num_suspended(self._engine))
        if snapshot != self._snapshot:
            self._snapshot = snapshot
            if self.on_load_change is not None:
                self._loop.call_soon_threadsafe(self.on_load_change, snapshot[0])

    def _publish(self, outputs: list[StepOutput], held: dict[str, HeldRequest]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs, held, self._num_publishes)
            self._num_publishes += 1

    def _deliver(self, outputs: list[StepOutput], held: dict[str, HeldRequest], publish: int) -> None:
        """On the event loop: the `publish`-th publish's outputs; `held`: those parked at their first token."""
        raise NotImplementedError

    def _fail_all(self, exc: BaseException) -> None:
        """On the event loop: a step raised `exc`; the engine never steps again."""
        raise NotImplementedError


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _num_suspended(engine: LLMEngine) -> int:
    """Requests out of the engine's batch and queue that it still holds (on the engine thread)."""
    return len(engine.scheduler.suspended)
