"""The requests running on this instance's engine, each with the stream its client reads.

Design: `EngineThread` runs the engine on its own thread; `EngineRunner` adds the table of
request streams on the event loop: admission (`add`; `adopt` for a request migrating in,
whose stream buffers its outputs until a client attaches), aborts, and the delivery of each
step's outputs to the stream of the request that made them. Outputs go to one asyncio queue
per request, so the gRPC side only ever awaits.

A request that migrates out ends its stream with a `Handoff` instead of a finish reason.
An id may be taken by a new copy of its request once the old one's stream left the table
(a resume here): `owns` says whether a stream's copy still has it, and the calls that take
a stream act on that copy only.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import structlog

from services.common.errors import Aborted, FerryError, Internal, Unavailable
from services.common.task_errors import shielded
from services.instance.engine.engine import LLMEngine
from services.instance.engine.step_output import StepOutput
from services.instance.engine.migration_state import HeldRequest
from services.instance.engine_thread import EngineThread
from services.instance.handoff import Handoff
from services.instance.request_copy import ANY_COPY, CopyRef
from services.instance.request_stream import RequestStream

__all__ = ["EngineRunner", "RequestStream"]

log = structlog.get_logger(__name__)


class EngineRunner(EngineThread):
    """The engine thread plus the stream of each request on it (touched on the event loop only)."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        # Streams whose abort waits for the engine: out of the table (their id is free for a new request at
        # once), but what the engine published before the abort still reaches them.
        self._aborting: dict[str, RequestStream] = {}
        self.num_requests_served = 0
        # A Generate request's first token, still running; with the request's parked hand-off
        # state when `holds_first_tokens()` said so in the step that made the token (PD push).
        self.on_prefilled: Callable[[str, HeldRequest | None], None] | None = None

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def add(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
                  priority: int = 0, resume_token_ids: tuple[int, ...] = (),
                  resume_text: str | None = None, first_start: int | None = None,
                  check_accepting: Callable[[], None] = lambda: None, attempt: int = 0,
                  replaced_migration_id: str = "") -> RequestStream:
        """Admit a request; raises the engine's validation errors (InvalidArgument, ...). `check_accepting`
        raises once the instance takes no more work: it runs right before the stream opens, in the same
        step, so a shutdown that began while a grammar was built either sees the request or refuses it.
        `replaced_migration_id`: a resume's, the migration whose copy here it replaced (engine.add_request)."""
        guide = None  # a grammar is built off the engine thread: a complex one takes a while
        if sampling.grammar:
            guide = await asyncio.to_thread(self._engine.new_guide, sampling, resume_token_ids, "resume_token_ids")
        check_accepting()

        def admit() -> None:
            self._engine.add_request(request_id, prompt_token_ids, sampling,
                                     priority=priority, resume_token_ids=resume_token_ids,
                                     resume_text=resume_text, guide=guide, first_start=first_start,
                                     replaced_migration_id=replaced_migration_id)

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

    def open_streams(self) -> tuple[RequestStream, ...]:
        """The streams of the requests here, running or waiting for a client to attach."""
        return tuple(self._streams.values())

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
