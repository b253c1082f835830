"""Typed async client of `ferry.v1.InstanceService` as the frontend uses it: pooled channels
by instance address, a deadline on every call, `x-request-id` metadata, errors mapped to
`FerryError`s, and fire-and-forget `Abort`s whose tasks are kept until they end.

A token stream (Generate, Attach) has no deadline as a whole, since a long generation may
rightly run for many minutes; instead each chunk must come within `generate_timeout_s` of the
one before (or of the start), or the instance is taken as failed and the request resumes
elsewhere. A dead or frozen instance is found sooner by the channel's keepalive pings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from services.common.errors import FerryError, PermissionDenied, Unauthenticated, Unavailable, error_from_rpc
from services.common.channel_pool import ChannelPool
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from services.frontend.convert import (abort_request_to_proto, attach_request_to_proto, chunk_from_proto,
                                       generate_request_to_proto)
from services.frontend.generation import CopyRef, GenerateSpec, RequestId, Target, TokenChunk

log = structlog.get_logger(__name__)

ABORT_TRIES = 3  # while the instance does not answer (UNAVAILABLE, DEADLINE_EXCEEDED)
ABORT_RETRY_PAUSE_S = 0.25  # then 0.5 s
# Not answered: the instance is down, or its event loop was blocked past the deadline before the
# handler ran (a handler that ran finishes the abort, so a repeat finds NOT_FOUND: harmless).
_ABORT_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class InstanceClients:
    def __init__(self, generate_timeout_s: float, abort_timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._generate_timeout_s = generate_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._pool = ChannelPool(tls)
        self._abort_tasks: set[asyncio.Task[None]] = set()

    def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        return self._chunks(target.address, lambda stub: stub.Generate(
            generate_request_to_proto(spec, target.can_prefill_on_decode),
            metadata=request_metadata(spec.request_id)))

    def attach(self, target: Target, request_id: RequestId, from_token_index: int,
               epoch: int) -> AsyncIterator[TokenChunk]:
        """The destination's stream of a handed-off request, from `from_token_index` on."""
        return self._chunks(target.address, lambda stub: stub.Attach(
            attach_request_to_proto(request_id, from_token_index, epoch),
            metadata=request_metadata(request_id)))

    async def _chunks(self, address: str, start: Callable[[instance_pb2_grpc.InstanceServiceStub], grpc.aio.UnaryStreamCall]
                      ) -> AsyncIterator[TokenChunk]:
        """The chunks of the stream `start` opens (on first iteration), errors mapped to FerryErrors."""
        async with self._pool.use(address) as channel:
            call = start(instance_pb2_grpc.InstanceServiceStub(channel))
            try:
                while (msg := await self._next_chunk(call)) is not None:
                    yield chunk_from_proto(msg)
            except grpc.aio.AioRpcError as exc:
                raise _as_frontends_error(error_from_rpc(exc), address) from exc
            finally:
                call.cancel()  # no-op after the stream ended; stops it when we leave early

    async def _next_chunk(self, call: grpc.aio.UnaryStreamCall) -> instance_pb2.GenerateChunk | None:
        """The stream's next message (None at its end), or Unavailable if none comes in time."""
        try:
            # Not wait_for: on Python 3.11 it drops a cancellation that lands as the chunk arrives
            # (CPython gh-86296), and a client that went away would never abort its request.
            async with asyncio.timeout(self._generate_timeout_s):
                msg = await call.read()
        except TimeoutError:
            raise Unavailable(f"no chunk from the instance in {self._generate_timeout_s:g} s "
                              "(--generate-timeout-s): taken as failed") from None
        return None if msg is grpc.aio.EOF else msg

    def abort_soon(self, target: Target, request_id: RequestId, copy: CopyRef | None = None) -> asyncio.Task[None]:
        """Abort `copy` (None: whatever copy runs there) in a task kept until it ends (so a cancelled caller still
        frees the instance's blocks)."""
        task = asyncio.get_running_loop().create_task(self._abort(target, request_id, copy), name=f"abort:{request_id}")
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)
        return task

    async def close(self) -> None:
        """Give the aborts in flight their tries, cancel what is left, then close the channels."""
        if self._abort_tasks:
            longest_s = ABORT_TRIES * self._abort_timeout_s + ABORT_RETRY_PAUSE_S * 2 ** ABORT_TRIES
            _, pending = await asyncio.wait(list(self._abort_tasks), timeout=longest_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._pool.close()

    async def _abort(self, target: Target, request_id: RequestId, copy: CopyRef | None) -> None:
        """Abort, tried ABORT_TRIES times while the instance does not answer (a request it holds with no
        client, such as one handed to it whose Attach failed, would decode until its watchdog drops it)."""
        for attempt in range(ABORT_TRIES):
            try:
                async with self._pool.use(target.address) as channel:
                    await instance_pb2_grpc.InstanceServiceStub(channel).Abort(
                        abort_request_to_proto(request_id, copy), timeout=self._abort_timeout_s,
                        metadata=request_metadata(request_id))
                log.info("request_aborted", request_id=request_id, instance_id=target.instance_id)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:  # finished or already freed: nothing to do
                    return
                if exc.code() not in _ABORT_RETRIED or attempt == ABORT_TRIES - 1:
                    log.warning("abort_failed", request_id=request_id, instance_id=target.instance_id,
                                code=exc.code().name, details=exc.details(), num_tries=attempt + 1)
                    return
                log.info("abort_retrying", request_id=request_id, instance_id=target.instance_id,
                         code=exc.code().name, num_tries=attempt + 1)
            await asyncio.sleep(ABORT_RETRY_PAUSE_S * 2 ** attempt)


def _as_frontends_error(error: FerryError, address: str) -> FerryError:
    """An instance refusing this frontend's credentials (cluster token, client certificate) is this
    frontend's misconfiguration, not its client's: never a 401/403 that blames the client's API key.
    UNAVAILABLE, so the request goes to an instance that accepts them; with none, the client gets a 503."""
    if isinstance(error, (Unauthenticated, PermissionDenied)):
        return Unavailable(f"the instance at {address} refused this frontend: {error.message}", error.request_id)
    return error
