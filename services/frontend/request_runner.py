"""Driving one request to its end, across instance failures.

Design: dispatch → stream the instance's chunks into the `ReqState` → on a broken stream
(UNAVAILABLE, deadline, a stream that ends without its finish chunk, a token gap)
re-dispatch excluding that instance and resume with `resume_token_ids` = the tokens the
client already has, at most `max_resumes` times, with a short growing pause; then the
request fails with an explicit error. Any other error (bad input, cache full) fails the
request at once. Whenever a stream is left before its finish chunk (also when the client
went away and this task is cancelled) the instance gets an `Abort`, so it frees the
request's KV blocks; a resume that lands on that same instance (the only one left)
waits for the Abort first, so the request id is free again there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from contextlib import aclosing
from typing import Protocol

import structlog

from services.common.errors import FerryError, Unavailable
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import GenerateSpec, InstanceId, RequestId, Target, TokenChunk
from services.frontend.req_state import ReqState

log = structlog.get_logger(__name__)


class InstanceStreams(Protocol):
    def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        """The instance's chunks; raises a FerryError (mapped from the gRPC status) on failure."""

    def abort_soon(self, target: Target, request_id: RequestId) -> Awaitable[None]:
        """Send Abort in the background (never blocks); the result ends when it did (never raises)."""


class RequestRunner:
    def __init__(self, dispatcher: Dispatcher, instances: InstanceStreams, *, max_resumes: int,
                 resume_backoff_s: float = 0.05, on_resume: Callable[[], None] = lambda: None) -> None:
        self._dispatcher = dispatcher
        self._instances = instances
        self._max_resumes = max_resumes
        self._resume_backoff_s = resume_backoff_s
        self._on_resume = on_resume

    async def run(self, state: ReqState, spec: GenerateSpec) -> None:
        """Feed `state` until the request finishes or fails (never raises a FerryError)."""
        excluded: list[InstanceId] = []
        aborts: dict[InstanceId, Awaitable[None]] = {}  # Aborts sent to instances this request left
        while not state.is_done:
            try:
                target = await self._dispatcher.pick(spec, excluded)
            except FerryError as exc:
                state.fail(exc)
                return
            if (abort := aborts.pop(target.instance_id, None)) is not None:
                await abort
            try:
                await self._stream(target, state, spec, aborts)
            except Unavailable as exc:
                if not state.is_done and self._can_resume(state, exc):
                    excluded.append(target.instance_id)
                    self._note_resume(state, target, exc)
                    await asyncio.sleep(self._resume_backoff_s * 2 ** (state.num_resumes - 1))
            except FerryError as exc:
                state.fail(exc)

    async def _stream(self, target: Target, state: ReqState, spec: GenerateSpec,
                      aborts: dict[InstanceId, Awaitable[None]]) -> None:
        """One Generate stream on `target`, resuming after the tokens `state` holds."""
        spec = replace(spec, resume_token_ids=tuple(state.token_ids))
        min_epoch = 0  # chunks of an older owner epoch (before a hand-off) are dropped
        try:
            async with aclosing(self._instances.generate(target, spec)) as chunks:
                async for chunk in chunks:
                    if chunk.epoch < min_epoch:
                        continue
                    min_epoch = chunk.epoch
                    state.accept(chunk)
                    if state.is_done:
                        return
            raise Unavailable(f"instance {target.instance_id} ended the stream of {spec.request_id} "
                              "before its last token")
        finally:
            if state.finish_reason is None:  # broken, failed or cancelled: free the instance's blocks
                aborts[target.instance_id] = self._instances.abort_soon(target, spec.request_id)

    def _can_resume(self, state: ReqState, exc: Unavailable) -> bool:
        if state.num_resumes < self._max_resumes:
            return True
        state.fail(Unavailable(f"request {state.request_id} failed after {state.num_resumes} resumes "
                               f"(--max-resumes {self._max_resumes}); last error: {exc.message}"))
        return False

    def _note_resume(self, state: ReqState, target: Target, exc: Unavailable) -> None:
        state.num_resumes += 1
        self._dispatcher.report_failure(target.instance_id)
        self._on_resume()
        log.warning("stream_resumed", request_id=state.request_id, failed_instance_id=target.instance_id,
                    num_tokens=state.num_output_tokens, num_resumes=state.num_resumes, error=exc.message)
