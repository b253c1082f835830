"""Driving one request to its end, across hand-offs (live migration) and instance failures.

Design: dispatch → stream the instance's chunks into the `ReqState` → follow every
hand-off → until the finish chunk.

* Hand-off: when the owner migrates the request, its stream ends with a chunk carrying
  `handoff` (destination, new epoch). We open `Attach(request_id, from_token_index=the
  next index the client still needs, epoch)` on the destination and keep feeding the
  same `ReqState`, so the client sees one stream. Chunks of an epoch older than the
  current owner's are dropped, and token indexes already held are dropped by the state.
  At most `max_handoffs` hand-offs in a row with no new token between them; past that
  the request is resumed elsewhere as if its stream broke (a request ping-ponging between
  instances without progress ends). A request that decodes between its moves follows
  any number of them.
* Resume: on a broken stream (UNAVAILABLE, deadline, a stream that ends without its
  finish chunk, a token gap, an Attach the destination refuses, a Generate refused for
  the instance's role) re-dispatch excluding
  the instance that broke and resume with `resume_token_ids` = the tokens the client
  already has, at most `max_resumes` times, with a short growing pause; then the
  request fails with an explicit error. Any other error (bad input, cache full) fails
  the request at once. Only an instance that took the request and failed (it sent a
  chunk, or it had not failed this request before) spends a resume: a resume that finds
  no serving instance (a lone instance frozen or restarting: its lease lapsed), or only
  the instance that failed it, failing again before it answers (a dead one's record not
  yet gone), waits for one, up to `resume_wait_s` per wait, and goes on as soon as one
  serves (`resume_waiting_for_instance`, once per wait).
* Seed: a sampled request without a seed gets one here, before its first dispatch, so
  every instance it runs on (after a resume too) samples token i from the same (seed, i)
  and the continuation is the one the first instance would have produced.

Whenever a stream is left before its finish chunk (also when the client went away and
this task is cancelled) the request's *current owner* (the last instance it was handed
off to) gets an `Abort`, so it frees the request's KV blocks; a resume that lands on
that same instance waits for the Abort first, so the request id is free again there.
Each Generate opened for the request is a new attempt (1, 2, ...), and the Abort names
the copy it ends (attempt, epoch): one that lands late, after a resume on that instance
or a hand-off back to it, leaves the newer copy alone.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from services.common.errors import (Aborted, FailedPrecondition, FerryError, Internal, NotFound, ResourceExhausted,
                                    Unavailable)
from services.common.log_sampling import LogSampler
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import CopyRef, GenerateSpec, Handoff, InstanceId, RequestId, Target, TokenChunk
from services.frontend.req_state import ReqState

log = structlog.get_logger(__name__)

# What an Attach may answer when the hand-off went wrong on the destination (it died and
# came back, lost the request, or holds a newer epoch): the request is resumed elsewhere.
_ATTACH_REFUSALS = (NotFound, Aborted, FailedPrecondition)


class InstanceStreams(Protocol):
    def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        """The instance's chunks; raises a FerryError (mapped from the gRPC status) on failure."""

    def attach(self, target: Target, request_id: RequestId, from_token_index: int,
               epoch: int) -> AsyncIterator[TokenChunk]:
        """The destination's chunks of a handed-off request, from `from_token_index` on."""

    def abort_soon(self, target: Target, request_id: RequestId, copy: CopyRef | None = None) -> Awaitable[None]:
        """Send Abort of `copy` (None: any) in the background (never blocks); the result ends when it did
        (never raises)."""


@dataclass(slots=True)
class _Owner:
    """The instance that holds the request now, and its epoch (grows with each hand-off)."""

    target: Target
    attempt: int  # the Generate this copy began with: 1 for the request's first, one more for each after it
    epoch: int = 0
    num_idle_handoffs: int = 0  # hand-offs followed since the last one after which a token came
    num_tokens_at_handoff: int = -1  # output tokens held at the last hand-off
    num_chunks: int = 0  # chunks it sent: none, and it never took the request


@dataclass(slots=True)
class _InstanceWait:
    """A resume's wait for a serving instance: until when (None: not waiting); ends when an instance answers."""

    until: float | None = None


LONE_RESUME_BACKOFF_S = 1.0  # the first resume's wait when no other instance serves; it doubles
NO_INSTANCE_WAIT_S = 2.0  # how long a new request that finds no instance registered at all waits for one
NO_INSTANCE_POLL_S = 0.1  # how often it looks again meanwhile (a resume waiting for an instance too)
RESUME_WAIT_S = 30.0  # a resume's longest wait for a serving instance (--resume-wait-s)
MANAGER_ONLY_POLL_S = 0.5  # without an instance list (no etcd) the wait asks the manager this often


class RequestRunner:
    def __init__(self, dispatcher: Dispatcher, instances: InstanceStreams, *, max_resumes: int,
                 max_handoffs: int = 16, resume_backoff_s: float = 0.05,
                 lone_resume_backoff_s: float = LONE_RESUME_BACKOFF_S, no_instance_wait_s: float = NO_INSTANCE_WAIT_S,
                 resume_wait_s: float = RESUME_WAIT_S,
                 on_resume: Callable[[], None] = lambda: None, on_handoff: Callable[[], None] = lambda: None) -> None:
        self._dispatcher = dispatcher
        self._instances = instances
        self._max_resumes = max_resumes
        self._max_handoffs = max_handoffs
        self._resume_backoff_s = resume_backoff_s
        self._lone_resume_backoff_s = lone_resume_backoff_s
        self._no_instance_wait_s = no_instance_wait_s
        self._resume_wait_s = resume_wait_s
        self._on_resume = on_resume
        self._on_handoff = on_handoff
        self._full_log = LogSampler()  # instance_full_trying_another: one line per instance per 10 s at most

    async def run(self, state: ReqState, spec: GenerateSpec) -> None:
        """Feed `state` until the request finishes or fails (never raises, but when cancelled)."""
        try:
            await self._run(state, spec)
        except Exception as exc:  # a bug must fail the request, never leave its client waiting
            log.exception("request_runner_failed", request_id=spec.request_id)
            state.fail(Internal(f"internal error ({type(exc).__name__}) while serving the request; see the "
                                "frontend log"))

    async def _run(self, state: ReqState, spec: GenerateSpec) -> None:
        spec = with_pinned_seed(spec)
        excluded: list[InstanceId] = []  # instances this request failed on (resumes go elsewhere)
        full: list[InstanceId] = []  # instances that refused it as full since its last resume
        full_refusal: ResourceExhausted | None = None  # the last of those refusals
        aborts: dict[InstanceId, Awaitable[None]] = {}  # Aborts sent to instances this request left
        no_instance_until = asyncio.get_running_loop().time() + self._no_instance_wait_s
        num_no_instance_waits = 0  # looks again for an instance while none is registered
        num_attempts = 0  # Generates opened for the request
        wait = _InstanceWait()  # a resume waiting for a serving instance
        while not state.is_done:
            try:
                target = await self._dispatcher.pick(_resumed(spec, state), [*excluded, *full])
            except Unavailable as exc:
                if full_refusal is not None:  # every instance left refused it as full: the client gets that (429)
                    state.fail(full_refusal)
                    return
                if state.num_resumes:  # nobody serves for a moment (a lone instance frozen or restarting)
                    if await self._waited_for_a_resume_instance(state, spec, wait, exc, NO_INSTANCE_POLL_S):
                        continue
                    return
                if not state.num_resumes and await self._waited_for_an_instance(state, no_instance_until,
                                                                                num_no_instance_waits):
                    num_no_instance_waits += 1
                    continue
                state.fail(exc)
                return
            except FerryError as exc:
                state.fail(exc)
                return
            if (abort := aborts.pop(target.instance_id, None)) is not None:
                await asyncio.shield(abort)  # a cancelled caller must not cancel the Abort: it frees blocks
            num_attempts += 1
            owner = _Owner(target, num_attempts)
            try:
                await self._follow(owner, state, spec, aborts)
            except Unavailable as exc:
                if state.is_done:
                    continue
                if not owner.num_chunks and target.instance_id in excluded:  # picked as nothing else serves,
                    # and failed again before it answered (dead, its record not gone yet; still frozen): no resume
                    await self._waited_for_a_resume_instance(state, spec, wait, exc, self._lone_resume_backoff_s)
                    continue
                wait.until = None
                if self._can_resume(state, exc):
                    excluded.append(owner.target.instance_id)
                    full.clear()  # full a moment ago, maybe not now: a resume may go there
                    full_refusal = None
                    self._note_resume(state, owner.target, exc)
                    await asyncio.sleep(self._resume_backoff(excluded, spec) * 2 ** (state.num_resumes - 1))
            except ResourceExhausted as exc:  # that instance is full (its waiting queue); another may not be
                if state.is_done or not self._try_another(state, owner.target, [*excluded, *full], exc):
                    state.fail(exc)
                else:
                    full.append(owner.target.instance_id)
                    full_refusal = exc
            except FerryError as exc:
                state.fail(exc)

    def _resume_backoff(self, excluded: Sequence[InstanceId], spec: GenerateSpec) -> float:
        """Short when another instance that holds the request serves; when only instances that failed this
        request are left (one instance, killed; others too small for it) 1, 2, 4 s: a restart takes that long at
        least, and while it runs the resume waits for an instance anyway (`_waited_for_a_resume_instance`)."""
        return (self._resume_backoff_s if self._dispatcher.serves_besides(excluded, spec)
                else self._lone_resume_backoff_s)

    async def _follow(self, owner: _Owner, state: ReqState, spec: GenerateSpec,
                      aborts: dict[InstanceId, Awaitable[None]]) -> None:
        """Generate on `owner`, resuming after the tokens `state` holds, then follow its hand-offs."""
        chunks = self._generated(owner, replace(_resumed(spec, state), attempt=owner.attempt))
        try:
            while (handoff := await self._feed(chunks, owner, state)) is not None:
                self._hand_off(owner, state, handoff)
                _call_off(aborts.pop(owner.target.instance_id, None))  # it holds the request again: keep it
                chunks = self._attached(owner, state)
        finally:
            if state.finish_reason is None:  # broken, failed or cancelled: free the owner's blocks
                aborts[owner.target.instance_id] = self._instances.abort_soon(
                    owner.target, spec.request_id, CopyRef(owner.attempt, owner.epoch))

    async def _feed(self, chunks: AsyncIterator[TokenChunk], owner: _Owner, state: ReqState) -> Handoff | None:
        """Feed one stream's chunks into `state`; the hand-off it ends with, or None once the request is done."""
        async with aclosing(chunks) as stream:
            async for chunk in stream:
                if chunk.epoch < owner.epoch:  # from before a hand-off: the new owner streams these tokens
                    continue
                owner.epoch = chunk.epoch
                owner.num_chunks += 1
                state.accept(chunk)
                if state.is_done:
                    return None
                if chunk.handoff is not None:
                    return chunk.handoff
        raise Unavailable(f"instance {owner.target.instance_id} ended the stream of {state.request_id} "
                          "before its last token")

    def _hand_off(self, owner: _Owner, state: ReqState, handoff: Handoff) -> None:
        """Make the destination the owner; Unavailable (resume elsewhere) past --max-handoffs in a row
        with no new token."""
        source = owner.target.instance_id
        owner.target = Target(handoff.dst_instance_id, handoff.dst_address)
        owner.epoch = max(owner.epoch, handoff.epoch)
        state.num_handoffs += 1
        has_progressed = state.num_output_tokens > owner.num_tokens_at_handoff
        owner.num_idle_handoffs = 1 if has_progressed else owner.num_idle_handoffs + 1
        owner.num_tokens_at_handoff = state.num_output_tokens
        self._on_handoff()
        log.info("stream_handed_off", request_id=state.request_id, src_instance_id=source,
                 dst_instance_id=handoff.dst_instance_id, epoch=handoff.epoch, num_tokens=state.num_output_tokens,
                 next_token_index=handoff.next_token_index, num_handoffs=state.num_handoffs)
        if owner.num_idle_handoffs > self._max_handoffs:
            raise Unavailable(f"request {state.request_id} was handed off {owner.num_idle_handoffs} times in a row "
                              f"with no new token (--max-handoffs {self._max_handoffs}); resuming it elsewhere")

    async def _generated(self, owner: _Owner, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        """The owner's Generate stream; a wrong-role refusal (a decode instance, the role just changed) reads as
        a broken stream, so the request is dispatched again elsewhere."""
        try:
            async with aclosing(self._instances.generate(owner.target, spec)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except FailedPrecondition as exc:
            raise Unavailable(f"instance {owner.target.instance_id} refused the request: {exc.message}") from exc

    async def _attached(self, owner: _Owner, state: ReqState) -> AsyncIterator[TokenChunk]:
        """The new owner's stream from the next token the client needs; a refused Attach reads as a broken stream."""
        attach = self._instances.attach(owner.target, state.request_id, state.num_output_tokens, owner.epoch)
        try:
            async with aclosing(attach) as chunks:
                async for chunk in chunks:
                    yield chunk
        except _ATTACH_REFUSALS as exc:
            raise Unavailable(f"attach to {owner.target.instance_id} after a hand-off failed: {exc.message}") from exc

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

    def _try_another(self, state: ReqState, target: Target, skipped: list[InstanceId],
                     exc: ResourceExhausted) -> bool:
        """Whether to send a request an instance refused as full to another one: while one it has not tried
        serves (a full instance costs no resume: those are for failures)."""
        if target.instance_id in skipped or not self._dispatcher.serves_besides([*skipped, target.instance_id]):
            return False  # (placed again on one it was sent away from: nothing else is left)
        if (suppressed := self._full_log.admit(target.instance_id)) is not None:  # a full cluster refuses each
            log.info("instance_full_trying_another", request_id=state.request_id, instance_id=target.instance_id,
                     error=exc.message, suppressed=suppressed)
        return True

    async def _waited_for_an_instance(self, state: ReqState, until: float, num_waits: int) -> bool:
        """A new request that finds no instance registered at all looks again a moment later, until `until`
        (False once that passed, or while some instance is registered: a drained cluster is no moment). Every
        lease can expire at once (etcd back from a freeze longer than the TTLs revokes them all) for the
        0.1-0.5 s until each instance has registered again; a request there got a 503 (found by a chaos run)."""
        loop = asyncio.get_running_loop()
        if not self._dispatcher.lists_instances or self._dispatcher.num_registered() or loop.time() >= until:
            return False
        if not num_waits:
            log.info("dispatch_waiting_for_instance", request_id=state.request_id, wait_s=round(until - loop.time(), 2))
        await asyncio.sleep(NO_INSTANCE_POLL_S)
        return True

    async def _waited_for_a_resume_instance(self, state: ReqState, spec: GenerateSpec, wait: _InstanceWait,
                                            exc: Unavailable, pause_s: float) -> bool:
        """A resume that found no instance to go to (or only the one that failed it, failing again unanswered)
        waits `pause_s`, then until an instance serves, within --resume-wait-s of the wait's start: True to
        look again, False once the request failed (the wait ran out). Spends no resume: a lone instance frozen
        or restarted past its lease's TTL (seconds under load) is served again, whatever --max-resumes says."""
        loop = asyncio.get_running_loop()
        if wait.until is None:
            wait.until = loop.time() + self._resume_wait_s
            log.warning("resume_waiting_for_instance", request_id=state.request_id, num_tokens=state.num_output_tokens,
                        num_resumes=state.num_resumes, wait_s=self._resume_wait_s, error=exc.message)
        lists_instances = self._dispatcher.lists_instances  # else only the manager knows: ask it now and then
        await asyncio.sleep(max(0.0, min(pause_s if lists_instances else max(pause_s, MANAGER_ONLY_POLL_S),
                                         wait.until - loop.time())))
        while lists_instances and not self._dispatcher.serves_besides((), spec) and loop.time() < wait.until:
            await asyncio.sleep(max(0.0, min(NO_INSTANCE_POLL_S, wait.until - loop.time())))
        if loop.time() < wait.until:
            return True
        state.fail(Unavailable(f"request {state.request_id} found no serving instance to resume on within "
                               f"{self._resume_wait_s:g} s (--resume-wait-s); last error: {exc.message}"))
        return False


def _resumed(spec: GenerateSpec, state: ReqState) -> GenerateSpec:
    """`spec` going on after the tokens `state` holds (the first try: none), as instances and the
    manager's placement must see it."""
    return replace(spec, resume_token_ids=tuple(state.token_ids), resume_text=state.plain_text,
                   resume_first_start=state.first_start)


def with_pinned_seed(spec: GenerateSpec) -> GenerateSpec:
    """`spec` with a seed drawn now if it samples without one (greedy requests need none)."""
    if spec.sampling.seed is not None or spec.sampling.temperature == 0.0:
        return spec
    return replace(spec, sampling=replace(spec.sampling, seed=secrets.randbits(64)))


def _call_off(abort: Awaitable[None] | None) -> None:
    """Stop an Abort still being tried (InstanceClients retries one the instance did not answer): landing
    late, it would end the request that instance was just handed again."""
    if isinstance(abort, asyncio.Future):
        abort.cancel()
