"""A generation's answer to its client, from its choices' deltas: one JSON body once every
choice has finished, or an SSE stream of chunks merged by choice index as they come.

A stream waits for every choice's first delta before it sends the 200, so an error the
instance raises early still gets its own status; after the 200 an error ends the stream
with an error event. A client that takes in none of its answer (a stream, or a JSON body,
which the handler writes itself: aiohttp would write it after the handler returned, with no
deadline) for --send-timeout-s while a write waits on it is dropped (_ReadWatch): it would
otherwise hold its handler and its --max-inflight slots, or its whole answer in memory, for as
long as it keeps the connection open.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import struct
import termios
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import structlog
from aiohttp import web

from services.common.errors import FerryError, Internal
from services.frontend.generation import GenerateSpec, RequestId
from services.frontend.metrics import FrontendMetrics
from services.frontend.off_loop import in_thread
from services.frontend.openai_protocol import ParsedRequest
from services.frontend.openai_response import SSE_DONE, ResponseFormatter, sse, sse_error
from services.frontend.req_state import Delta, ReqState
from services.frontend.request_ids import HEADER as REQUEST_ID_HEADER
from services.frontend.request_ids import REQUEST_ID_KEY

log = structlog.get_logger(__name__)

JSON_SLICE_BYTES = 1 << 16  # a JSON body is written in pieces of this size (aiohttp drains its buffer past it)


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the `n` answers to a request: its own instance request, state and formatter."""

    state: ReqState
    spec: GenerateSpec
    formatter: ResponseFormatter


class AnswerWriter:
    def __init__(self, metrics: FrontendMetrics, send_timeout_s: float) -> None:
        self._metrics = metrics
        self._send_timeout_s = send_timeout_s

    async def complete(self, request: web.Request, request_id: RequestId, choices: list[Choice],
                       streams: list[AsyncIterator[Delta]]) -> web.StreamResponse:
        drains = [asyncio.create_task(_drain(stream)) for stream in streams]
        try:
            await asyncio.gather(*drains)  # raises the first choice's error as it is
        finally:
            for drain in drains:
                await cancel_task(drain)
        return await self._json(request, request_id, await in_thread(_json_body, choices))

    async def _json(self, request: web.Request, request_id: RequestId, data: bytes) -> web.StreamResponse:
        """The JSON answer, written here piece by piece under the _ReadWatch (what aiohttp would
        write after the handler returned has no deadline)."""
        response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8",
                                               REQUEST_ID_HEADER: request_id})
        response.content_length = len(data)
        try:
            await self._taken_in(request, response.prepare(request))
            for start in range(0, len(data), JSON_SLICE_BYTES):
                await self._send(request, response, data[start:start + JSON_SLICE_BYTES])
            await self._taken_in(request, response.write_eof())
        except ConnectionResetError:
            log.info("client_disconnected", request_id=request_id, num_answer_bytes=len(data))
        return response

    async def stream(self, request: web.Request, parsed: ParsedRequest, request_id: RequestId,
                     choices: list[Choice], streams: list[AsyncIterator[Delta]]) -> web.StreamResponse:
        firsts = [await anext(stream) for stream in streams]  # an early error raises here, before the 200
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               REQUEST_ID_HEADER: request_id})
        try:
            await response.prepare(request)  # the client may be gone already
            for choice, first in zip(choices, firsts):
                for chunk in choice.formatter.first_chunks(choice.state):
                    await self._send(request, response, sse(chunk))
                await self._send(request, response, sse(choice.formatter.chunk(first)))
            try:
                async for index, delta in _merged(streams):
                    await self._send(request, response, sse(choices[index].formatter.chunk(delta)))
            except FerryError as exc:  # after the 200: an error event ends the stream
                log.warning("stream_failed", request_id=request_id, error=exc.message)
                self._metrics.stream_errors.labels(str(exc.http_status)).inc()
                await self._send(request, response, sse_error(exc))
            if parsed.include_usage and all(c.state.error is None for c in choices):
                await self._send(request, response, sse(choices[0].formatter.usage_chunk([c.state for c in choices])))
            await self._send(request, response, SSE_DONE)
            await self._taken_in(request, response.write_eof())
        except ConnectionResetError:
            log.info("client_disconnected", request_id=request_id,
                     num_output_tokens=sum(c.state.num_output_tokens for c in choices))
        except Exception:
            if not response.prepared:
                raise  # still before the 200: the error middleware answers a 500
            log.exception("stream_crashed", request_id=request_id)
            self._metrics.stream_errors.labels("500").inc()  # its error event is an Internal's
            await self._end_crashed_stream(request, response)
        return response

    async def _end_crashed_stream(self, request: web.Request, response: web.StreamResponse) -> None:
        """A bug after the 200: an error event and [DONE], so the client is not left waiting on an open stream;
        under the _ReadWatch like every write (before, a client that stopped reading held the handler here)."""
        try:
            await self._send(request, response, sse_error(Internal("internal error; the server logged it under "
                                                                   "this request's x-request-id")))
            await self._send(request, response, SSE_DONE)
            await self._taken_in(request, response.write_eof())
        except Exception:  # noqa: BLE001 — the connection is broken as well: close it, which ends the stream too
            if request.transport is not None:
                request.transport.close()

    async def _send(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        if _writes_at_once(request, len(data)):  # most of a stream's writes: no timer nor ioctl for each token
            await response.write(data)
        else:
            await self._taken_in(request, response.write(data))

    async def _taken_in(self, request: web.Request, write: Awaitable[None]) -> None:
        """Await `write`, whose bytes the client must take in (_ReadWatch cuts one that takes in nothing)."""
        watch = _ReadWatch(request, self._send_timeout_s)
        try:
            await write
        finally:
            watch.cancel()


class _ReadWatch:
    """Drops the connection once its client took in nothing for --send-timeout-s while a write waits on
    it: one that stopped reading would otherwise hold its handler, and its --max-inflight slots or its
    answer in memory, for as long as it kept the connection open. A client that reads, however slowly,
    keeps it (before, a write had to be taken in whole within the timeout, and a write waits until the
    buffers drain: megabytes with the kernel's). The drop cancels the handler, as a client gone does.
    (The write is not cancelled instead: aiohttp's drain waiter would stay cancelled for the next write.)"""

    def __init__(self, request: web.Request, timeout_s: float) -> None:
        self._request = request
        self._timeout_s = timeout_s
        self._sent = _bytes_sent(request)
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._check)

    def cancel(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        sent = _bytes_sent(self._request)
        if sent > self._sent:  # the client took some in: it gets another --send-timeout-s
            self._sent = sent
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._check)
            return
        log.warning("client_not_reading", request_id=self._request.get(REQUEST_ID_KEY), send_timeout_s=self._timeout_s)
        if self._request.transport is not None:
            self._request.transport.abort()


def _writes_at_once(request: web.Request, num_bytes: int) -> bool:
    """A write of `num_bytes` cannot wait on the client: the connection's transport is not paused and stays at or
    under its high-water mark with them (asyncio pauses it, and only then does aiohttp's write wait, above that)."""
    transport = request.transport
    limits = getattr(transport, "get_write_buffer_limits", None)
    if transport is None or limits is None or request.protocol.writing_paused:
        return False
    return transport.get_write_buffer_size() + num_bytes + _FRAMING_BYTES <= limits()[1]


_FRAMING_BYTES = 1024  # more than chunked encoding adds around a write (a size line and CRLFs)


def _bytes_sent(request: web.Request) -> int:
    """Bytes of this connection's answers the client's side took (grows as the client reads): what left
    aiohttp's buffer less what the kernel still holds unacknowledged (Linux; elsewhere, what left aiohttp's
    buffer, which the kernel's send buffer, up to megabytes, hides for a while)."""
    transport = request.transport
    if transport is None:
        return request.writer.output_size
    return request.writer.output_size - transport.get_write_buffer_size() - _kernel_unacked(transport)


def _kernel_unacked(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


async def cancel_task(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it to end (nothing to do once it is done)."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _json_body(choices: list[Choice]) -> bytes:
    """The non-streaming answer's bytes: in a worker thread, since n choices with top logprobs take
    the loop for a second or more (8 x 1000 tokens x 20 top logprobs: 1.1 s on the tiny model)."""
    body = choices[0].formatter.response([c.state for c in choices], [c.formatter.choice(c.state) for c in choices])
    return json.dumps(body).encode()


async def _drain(deltas: AsyncIterator[Delta]) -> None:
    async for _ in deltas:
        pass


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream as they come; a stream's error raises here."""
    if len(streams) == 1:  # the common case, without the tasks
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue(maxsize=4 * len(streams))

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, None))
        except FerryError as exc:
            await queue.put((index, exc))
    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get())[1] is not None:
                if isinstance(item[1], BaseException):
                    raise item[1]
                yield item
    finally:
        for task in pumps:
            await cancel_task(task)
