"""Runs the engine on its own thread so the event loop never blocks.

Design: the engine (`LLMEngine`) is plain, single-threaded logic. `EngineRunner`
owns it on one thread whose loop reads aloud:

    run queued commands  →  step if there is work  →  publish outputs  →  snapshot load

Commands (add, abort, list) are closures queued from the event loop; their
results come back as asyncio futures. Outputs go to one asyncio queue per request,
fed with `loop.call_soon_threadsafe`, so the gRPC side only ever awaits.

A request that migrates out ends its stream with a `Handoff` instead of a finish
reason; one that migrates in gets a stream at once (`adopt`), which buffers its
outputs until a client attaches.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from services.common.errors import Aborted, FerryError, Internal, Unavailable
from services.common.task_errors import shielded
from services.instance.engine.engine import LLMEngine, LoadSnapshot, StepOutput
from services.instance.engine.migration_state import HeldRequest
from services.instance.handoff import Handoff
from services.instance.request_copy import ANY_COPY, CopyRef
from services.instance.step_times import StepTimes

log = structlog.get_logger(__name__)

_IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class RequestStream:
    """The outputs of one request, in order; ends after the output with a finish reason,
    or with a `Handoff` when the request moved to another instance."""

    request_id: str
    outputs: asyncio.Queue[StepOutput | Handoff | BaseException]
    epoch: int = 0  # the request's owner epoch on this instance
    attempt: int = 0  # the frontend's attempt at the request that this copy belongs to (0: unknown; request_copy)
    from_token_index: int = 0  # the first output its client asked for (a resume's tokens, an Attach's index)
    is_finished: bool = False
    is_attached: bool = False  # a client reads it (always for Generate; after Attach for migrated-in requests)
    is_prefilling: bool = False  # prefilled here (Generate) and no output yet: its first output ends the prefill
    has_unread_finish: bool = False  # finished before a client attached: kept until one does (or the watchdog)
    handoff: Handoff | None = None  # queued as its last item (the request moved); read once is_finished
    # The first of the engine thread's publishes that can hold its outputs: set there when its request was
    # admitted. Earlier ones are another request's under the same id (one aborted for a resume of it here).
    first_publish: int | None = None

    def takes(self, publish: int) -> bool:
        """Whether outputs of the engine thread's `publish`-th publish under its id are its request's."""
        return self.first_publish is not None and publish >= self.first_publish

    @property
    def has_unread_handoff(self) -> bool:
        """Handed off, and the hand-off still queued: nobody reading this stream knows where the request went."""
        return self.handoff is not None and not self.is_finished

    async def __aiter__(self) -> AsyncIterator[StepOutput | Handoff]:
        while not self.is_finished:
            item = await self.outputs.get()
            if isinstance(item, BaseException):
                self.is_finished = True
                raise item
            self.is_finished = isinstance(item, Handoff) or item.finish_reason is not None
            yield item


class EngineRunner:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        # Streams whose abort waits for the engine: out of the table (their id is free for a new request at
        # once), but what the engine published before the abort still reaches them.
        self._aborting: dict[str, RequestStream] = {}
        # (load, requests suspended): replaced whole after every step and command; readers never see a torn
        # value, nor a request suspended or resumed in between counted in neither figure.
        self._snapshot: tuple[LoadSnapshot, int] = (engine.load(), _num_suspended(engine))
        self.prefix_cache_stats = engine.prefix_cache_stats()  # the same, for metrics
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._num_publishes = 0  # steps' outputs sent to the event loop so far (engine thread only)
        self.num_requests_served = 0
        self.step_times = StepTimes()  # the engine thread adds each step's; /metrics and load reports read them
        self.num_steps = 0
        self.is_broken = False  # set when a step raised; the instance then refuses new work
        self._step_started_at: float | None = None  # monotonic, while a step runs (engine thread writes it)
        self.on_load_change: Callable[[LoadSnapshot], None] | None = None
        # A Generate request's first token, still running; with the request's parked hand-off
        # state when `holds_first_tokens()` said so in the step that made the token (PD push).
        self.on_prefilled: Callable[[str, HeldRequest | None], None] | None = None
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
    def num_active(self) -> int:
        return len(self._streams)

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

    async def add(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
                  priority: int = 0, resume_token_ids: tuple[int, ...] = (),
                  resume_text: str | None = None, first_start: int | None = None,
                  check_accepting: Callable[[], None] = lambda: None, attempt: int = 0) -> RequestStream:
        """Admit a request; raises the engine's validation errors (InvalidArgument, ...). `check_accepting`
        raises once the instance takes no more work: it runs right before the stream opens, in the same
        step, so a shutdown that began while a grammar was built either sees the request or refuses it."""
        guide = None  # a grammar is built off the engine thread: a complex one takes a while
        if sampling.grammar:
            guide = await asyncio.to_thread(self._engine.new_guide, sampling, resume_token_ids, "resume_token_ids")
        check_accepting()

        def admit() -> None:
            self._engine.add_request(request_id, prompt_token_ids, sampling,
                                     priority=priority, resume_token_ids=resume_token_ids,
                                     resume_text=resume_text, guide=guide, first_start=first_start)

        return await self._open_stream(request_id, CopyRef(attempt, 0), admit, is_attached=True,
                                       from_token_index=len(resume_token_ids))

    async def adopt(self, request_id: str, copy: CopyRef, admit: Callable[[], None]) -> RequestStream:
        """Open the stream of a request migrating in and run `admit` (its import) on the engine thread.

        Its outputs wait in the stream until a client attaches."""
        return await self._open_stream(request_id, copy, admit, is_attached=False)

    async def hand_off(self, request_id: str, handoff: Handoff, stream: RequestStream | None) -> None:
        """The request now runs elsewhere: end its stream with `handoff` at once (the client
        attaches to the destination meanwhile), then release it on the engine thread.
        `stream`: the request's stream when its migration began. Aborted, and nothing released, if that copy
        no longer owns the id: it was aborted (its abort is queued), and another copy under its id (a resume
        here, maybe parked by its own PD hand-off) is not the migrated request.

        Every output it produced is already in the stream: it was suspended by an engine call
        that returned, and results and outputs reach the event loop in the order the engine
        thread sent them."""
        if not self.owns(stream):
            raise Aborted(f"request {request_id} was aborted here before its hand-off to {handoff.dst_instance_id}")
        del self._streams[request_id]
        stream.handoff = handoff
        stream.outputs.put_nowait(handoff)

        def release() -> None:
            try:
                self._engine.release(request_id)
            except FerryError:
                # Announced elsewhere, so it must not go on here. In the same command: once it returns, a resume
                # of the request may be admitted here under its id, and that copy is not this hand-off's.
                self._engine.abort(request_id)
                raise

        await self.call(release)

    def owns(self, stream: RequestStream | None) -> bool:
        """Whether `stream`'s copy of its request still owns the id here. An engine command on the id queued
        while it does acts on that copy: another copy is admitted only after this stream left the table (its
        abort queued first), and commands run in order."""
        return stream is not None and self._streams.get(stream.request_id) is stream

    async def resume(self, stream: RequestStream | None) -> bool:
        """Put `stream`'s request back into the batch if it is suspended (a failed migration, a hand-off that
        could not happen). False if it was not suspended, or if it no longer owns its id (aborted; a newer
        copy under the id, which whoever suspended it resumes, is left alone)."""
        if not self.owns(stream):
            return False
        return await self.call(lambda: self._engine.resume(stream.request_id))

    def resume_soon(self, stream: RequestStream | None) -> None:
        """`resume` without waiting."""
        if self.owns(stream):
            self.call_soon(functools.partial(self._engine.resume, stream.request_id))

    def attach(self, stream: RequestStream, from_token_index: int = 0) -> None:
        """A client reads `stream` now; one that already finished leaves the table (its outputs are queued)."""
        stream.is_attached, stream.from_token_index = True, from_token_index
        if stream.has_unread_finish and self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def stream(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    async def take_over(self, request_id: str, from_token_index: int, attempt: int = 0) -> bool:
        """A resume of `request_id` from output `from_token_index` on, while a client reads it here: one gone
        unnoticed (this instance was frozen as its connection dropped). Its stream ends UNAVAILABLE after what it
        holds, and the request is aborted; Aborted instead if that stream began at a later output (this resume
        is the older attempt: a frontend's tokens only grow) or belongs to a later attempt (request_copy).
        False if no client reads the request here."""
        stream = self._streams.get(request_id)
        if stream is None or not stream.is_attached:
            return False
        if from_token_index < stream.from_token_index or CopyRef(attempt).is_older_than(stream.attempt, 0):
            raise Aborted(f"request {request_id} runs here from output {stream.from_token_index} on; this older "
                          f"attempt at it, from output {from_token_index}, is not taken up")
        await self.abort(request_id, Unavailable(f"request {request_id} was resumed on this instance by a newer "
                                                 "attempt, which this stream's client is not"))
        return True

    def unattached_request_ids(self) -> frozenset[str]:
        """Requests that migrated in and that no client reads yet."""
        return frozenset(r for r, stream in self._streams.items() if not stream.is_attached)

    async def _open_stream(self, request_id: str, copy: CopyRef, admit: Callable[[], None],
                           is_attached: bool, from_token_index: int = 0) -> RequestStream:
        if self.is_broken:
            raise Unavailable("the engine failed (see the instance log); send the request to another instance")
        if request_id in self._streams:  # a lost race (a resume here, another commit got in first): not a bad field
            raise Aborted(f"request {request_id} is already running on this instance (another attempt at it got "
                          "here first)")
        stream = RequestStream(request_id, asyncio.Queue(), epoch=copy.epoch, attempt=copy.attempt,
                               from_token_index=from_token_index, is_attached=is_attached,
                               is_prefilling=copy.epoch == 0)
        self._streams[request_id] = stream  # before admission: the first step may deliver at once
        admitted = threading.Event()

        def admit_and_note() -> None:
            admit()
            stream.first_publish = self._num_publishes  # what was published before is an earlier request's
            admitted.set()
        try:
            await self.call(admit_and_note)
        except asyncio.CancelledError:
            # The caller left (a client gone, an RPC deadline) with the admission queued: it still runs on the
            # engine thread, and the request must not run there with no stream. Commands run in order, so
            # this one comes after it.
            self._drop_stream(stream)
            self.call_soon(lambda: admitted.is_set() and self._engine.abort(request_id))
            raise
        except BaseException:
            self._drop_stream(stream)
            raise
        return stream

    def _drop_stream(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def abort_soon(self, stream: RequestStream) -> None:
        """Abort `stream`'s request without waiting (safe from a cancelled coroutine's finally block).

        Matches on the stream object, so a late cancel never hits a newer request with the same id."""
        if self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        self.call_soon(lambda: self._engine.abort(stream.request_id))  # its error is logged; the thread goes on

    async def abort(self, request_id: str, ending: BaseException | None = None, copy: CopyRef = ANY_COPY) -> bool:
        """Abort a request; a client still reading its stream gets a last output with finish reason ABORT
        (or `ending`, raised) after every output the engine published before, so the stream has no gap. Its id
        is free for a new request at once. A caller cancelled meanwhile does not stop it: the engine aborts the
        request anyway, and its stream must end with it. A copy newer than `copy` is left alone (False)."""
        return await shielded(self._abort(request_id, ending, copy))

    async def _abort(self, request_id: str, ending: BaseException | None, copy: CopyRef) -> bool:
        if (newer := self._streams.get(request_id)) is not None and copy.is_older_than(newer.attempt, newer.epoch):
            log.info("abort_of_older_copy_ignored", request_id=request_id, attempt=copy.attempt, epoch=copy.epoch,
                     running_attempt=newer.attempt, running_epoch=newer.epoch)
            return False
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._aborting[request_id] = stream
        try:
            output = await self.call(lambda: self._engine.abort_with_output(request_id))
        finally:
            if stream is not None and self._aborting.get(request_id) is stream:
                del self._aborting[request_id]
        if stream is not None and not stream.is_finished:
            stream.outputs.put_nowait(ending or output or Aborted(f"request {request_id} aborted"))
        return output is not None

    def abandon_all(self, error: BaseException) -> int:
        """End every stream with `error` and abort its request once the engine takes commands
        again (a stalled step); how many streams there were."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.outputs.put_nowait(error)
            self.call_soon(functools.partial(self._engine.abort, stream.request_id))
        return len(streams)

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
            self._snapshot_load_logged()

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
        self.step_times.add(time.perf_counter() - started)
        self.num_steps += 1
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
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or not stream.takes(publish):  # none, or a new request's under an aborted one's id
                if (aborting := self._aborting.get(output.request_id)) and aborting.takes(publish):
                    aborting.outputs.put_nowait(output)  # published before its abort: no gap in its stream
                continue
            stream.outputs.put_nowait(output)
            if output.finish_reason is not None:
                self.num_requests_served += 1
                if stream.is_attached:
                    del self._streams[output.request_id]
                else:  # migrated in and finished before the client's Attach: Attach must still find it
                    stream.has_unread_finish = True
            elif output.new_token_ids and (stream.is_prefilling or output.request_id in held):
                # (held: parked at its first token, also one that migrated in before it had any: its hand-off
                # must be queued, or it stays parked)
                stream.is_prefilling = False
                if self.on_prefilled is not None:
                    self.on_prefilled(output.request_id, held.get(output.request_id))


    def _fail_all(self, exc: BaseException) -> None:
        error = Internal(f"engine step failed: {type(exc).__name__}")
        for stream in self._streams.values():
            stream.outputs.put_nowait(error)
        self._streams.clear()


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
