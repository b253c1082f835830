"""gRPC servicer of one instance: thin, proto → domain → runner → proto."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc
import structlog

from services.common.error_text import typed_error_text
from services.common.errors import (Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted,
                                    Unavailable)
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.pick_announcement import (REFUSED_BY_DESTINATION, REFUSED_BY_TRANSFER, pick_to_metadata,
                                               refused_by_metadata)
from services.common.task_errors import shielded
from services.instance.config import InstanceRole
from services.instance.convert import (check_request_id, chunk_to_proto, handoff_chunk_to_proto, load_to_proto,
                                       migrate_out_plan_from_proto, migration_result_to_proto,
                                       request_info_to_proto, request_state_from_proto, reservation_to_proto, role_from_proto,
                                       role_to_proto, sampling_from_proto)
from services.instance.engine.step_output import StepOutput
from services.instance.engine.migration_state import check_serves_length
from services.instance.handoff import Handoff
from services.instance.migration import MigrationDriver
from services.instance.migration_domain import RefusedByTransfer
from services.instance.migration_in import MigrationInbox
from services.instance.pd_handoff import DecodeHandoff
from services.instance.request_copy import CopyRef
from services.instance.request_stream import RequestStream
from services.instance.runner import EngineRunner

log = structlog.get_logger(__name__)

LIST_REQUESTS_WAIT_S = 0.25  # for the engine thread to list its requests between steps, before reading them directly


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    instance_id: str
    address: str
    role: InstanceRole
    model: str
    max_model_len: int
    kv_geometry: common_pb2.KvGeometry


class InstanceServicer(instance_pb2_grpc.InstanceServiceServicer):
    def __init__(self, runner: EngineRunner) -> None:
        self.identity: InstanceIdentity | None = None  # set once the server knows its port
        self._runner = runner
        # Live migration, set with the identity (before SERVING): the source side, the destination side.
        self.migrations: MigrationDriver | None = None
        self.inbox: MigrationInbox | None = None
        self.is_accepting = True  # False while draining or shutting down
        self.is_engine_stalled: Callable[[], bool] = lambda: False  # StallWatchdog.is_stalled, once wired
        # Prefill/decode disaggregation, set with the identity: the hand-off pusher, and what a role change
        # does besides replacing the identity (rewrite the etcd record).
        self.handoff: DecodeHandoff | None = None
        self.on_role_change: Callable[[InstanceIdentity], Awaitable[None]] | None = None
        self.role_lock = asyncio.Lock()  # one role change at a time, start-up's registration included (app.py)
        # The role a SetRole is writing to etcd, before it is the role here: managers may act on the new record
        # already, so meanwhile this instance refuses only what both roles refuse (`_refuses_as`).
        self._role_being_set: InstanceRole | None = None
        self._streams_sent: set[RequestStream] = set()  # those Generate and Attach calls send now

    async def Generate(self, request: instance_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[instance_pb2.GenerateChunk]:
        request_id = check_request_id(request.request_id)
        self._check_accepting("new requests")
        if not request.HasField("sampling"):
            raise InvalidArgument("sampling: required (at least sampling.max_tokens)")
        if self._refuses_as(InstanceRole.DECODE) and not request.can_prefill_on_decode:
            raise FailedPrecondition(f"instance {self.identity.instance_id} has role decode and takes no new "
                                     "prefills; send the request to a prefill instance (the manager's Dispatch), "
                                     "or set can_prefill_on_decode when none serves")
        replaced = ""  # a resume of a request whose migration here nobody attached to replaces it
        if self.inbox is not None:
            replaced = await self.inbox.drop_unattached(request_id)
        if await self._runner.take_over(request_id, len(request.resume_token_ids), request.attempt):  # one whose client left
            log.warning("request_replaced_by_resume", request_id=request_id,
                        from_token_index=len(request.resume_token_ids))
        stream = await self._runner.add(
            request_id, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
            priority=request.priority, resume_token_ids=tuple(request.resume_token_ids),
            resume_text=request.resume_text if request.HasField("resume_text") else None,
            first_start=request.resume_first_start if request.HasField("resume_first_start") else None,
            check_accepting=lambda: self._check_accepting("new requests"),  # again: SIGTERM may have come meanwhile
            attempt=request.attempt, replaced_migration_id=replaced)
        log.info("request_started", request_id=request_id, num_prompt_tokens=len(request.prompt_token_ids),
                 num_resume_tokens=len(request.resume_token_ids))
        async for chunk in self._chunks(stream, from_token_index=0):
            yield chunk

    async def Attach(self, request: instance_pb2.AttachRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[instance_pb2.GenerateChunk]:
        request_id = check_request_id(request.request_id)
        stream = self.inbox.attach(request_id, request.epoch, request.from_token_index)
        log.info("request_attached", request_id=request_id, epoch=request.epoch,
                 from_token_index=request.from_token_index)
        async for chunk in self._chunks(stream, from_token_index=request.from_token_index):
            yield chunk

    async def _chunks(self, stream: RequestStream, from_token_index: int) -> AsyncIterator[instance_pb2.GenerateChunk]:
        """The stream's chunks from `from_token_index` on; a client that goes away aborts the request."""
        self._streams_sent.add(stream)
        try:
            async for output in stream:
                if isinstance(output, Handoff):
                    yield handoff_chunk_to_proto(stream.request_id, output, stream.epoch)
                elif _is_news(output, from_token_index):
                    yield chunk_to_proto(output, epoch=stream.epoch)
        finally:
            self._streams_sent.discard(stream)
            if not stream.is_finished:  # the client went away (or we are shutting down)
                self._runner.abort_soon(stream)
                if stream.has_unread_handoff and self.migrations is not None:  # nobody can follow it: drop the copy
                    self.migrations.drop_unread_handoff(stream.request_id, stream.handoff)
                log.info("request_cancelled", request_id=stream.request_id)

    def open_streams(self) -> set[RequestStream]:
        """The streams whose client has not read their end: those being sent (a finished request's last chunks
        among them) and those of requests migrated in that no client attached to yet."""
        return self._streams_sent | set(self._runner.open_streams())

    async def Abort(self, request: instance_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> instance_pb2.AbortResponse:
        request_id = check_request_id(request.request_id)
        # Shielded as one: a caller whose deadline passes first (the frontend's --abort-timeout-s, 2 s, against an
        # engine step of seconds) cancels this handler, and must not stop it between the two (before, the copy of
        # a request that left decoded for no client until the destination's watchdog dropped it).
        was_running = await shielded(self._abort_or_drop(request_id, CopyRef(request.attempt, request.epoch)))
        if not was_running:  # finished, or its client's cancelled stream freed it first: what the caller wants
            raise NotFound(f"request {request_id} is not on instance {self.identity.instance_id}", is_expected=True)
        log.info("request_aborted", request_id=request_id)
        return instance_pb2.AbortResponse(was_running=True)

    async def _abort_or_drop(self, request_id: str, copy: CopyRef) -> bool:
        """Abort the request here unless a copy newer than `copy` runs; one that left moments ago has its copy
        dropped where it went."""
        if await self._runner.abort(request_id, copy=copy):
            if self.inbox is not None:  # migrated in, and its client left before it attached: nothing left to expire
                self.inbox.forget_committed(request_id)
            return True
        if self._runner.stream(request_id) is not None:  # a newer copy: the Abort was sent before it came
            return False
        return await self._drop_unread_handoff(request_id, copy)

    async def _drop_unread_handoff(self, request_id: str, copy: CopyRef) -> bool:
        """A client aborting a request that migrated from here moments ago never read its hand-off (one that
        did aborts the destination): drop the copy there, which nobody will attach to. False if none is, or if
        the copy that left is newer than `copy` (a late Abort: its frontend attaches to it)."""
        handoff = self.migrations.recent_handoff(request_id) if self.migrations is not None else None
        if handoff is None or copy.is_older_than(handoff.attempt, handoff.epoch - 1):  # its epoch here: one less
            return False
        return await shielded(self.migrations.drop_unread_handoff(request_id, handoff))  # logs what it did

    async def GetStatus(self, request: instance_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> instance_pb2.GetStatusResponse:
        identity = self.identity
        return instance_pb2.GetStatusResponse(
            instance_id=identity.instance_id, address=identity.address, role=role_to_proto(identity.role),
            model=identity.model, kv=identity.kv_geometry, load=self.load_report(), pid=os.getpid(),
            host=socket.gethostname(), max_model_len=identity.max_model_len)

    async def ListRequests(self, request: instance_pb2.ListRequestsRequest,
                           context: grpc.aio.ServicerContext) -> instance_pb2.ListRequestsResponse:
        try:
            async with asyncio.timeout(LIST_REQUESTS_WAIT_S):
                infos = await self._runner.call(lambda: self._runner.engine.list_requests())
        except TimeoutError:  # the engine is in a long step (a big prefill chunk): read the table as it is
            infos = self._runner.engine.list_requests()
        return instance_pb2.ListRequestsResponse(
            requests=[request_info_to_proto(info, self.identity.instance_id) for info in infos])

    # Live migration (README "Live migration").

    async def MigrateOut(self, request: instance_pb2.MigrateOutRequest,
                         context: grpc.aio.ServicerContext) -> instance_pb2.MigrateOutResponse:
        try:
            result = await self.migrations.migrate_out(migrate_out_plan_from_proto(request),
                                                       on_picked=lambda *pick: _announce(context, *pick))
        except Unavailable as exc:
            # This instance answers: a peer did not (the destination or a transfer service). Said
            # as UNAVAILABLE, the manager would take it for this source being down or frozen.
            raise Aborted(f"request not migrated, it keeps running on {self.identity.instance_id}: {exc.message}",
                          request_id=exc.request_id) from exc
        except ResourceExhausted as exc:
            if exc.trailing_metadata:  # the source's own busy slots (x-ferry-source-busy): as it is
                raise
            raise _saying_who_ran_out(exc) from exc
        return migration_result_to_proto(result)

    async def PrepareMigrateIn(self, request: instance_pb2.PrepareMigrateInRequest,
                               context: grpc.aio.ServicerContext) -> instance_pb2.PrepareMigrateInResponse:
        self._check_accepting("migrations")
        if not request.grow_only and not request.can_decode_on_prefill:  # one under way goes on
            self._check_takes_decodes(request.request_id)
        check_serves_length(request.request_id, request.max_num_tokens, self.identity.max_model_len)
        reservation = await self.inbox.prepare(request.migration_id, request.request_id, request.src_instance_id,
                                                request.num_blocks, grow_only=request.grow_only,
                                                block_hashes=tuple(request.block_hashes),
                                                keep_cached_blocks=request.keep_cached_blocks
                                                if request.HasField("keep_cached_blocks") else None,
                                                num_leading_blocks_not_held=request.num_leading_blocks_not_held)
        return reservation_to_proto(reservation)

    async def CommitMigrateIn(self, request: instance_pb2.CommitMigrateInRequest,
                              context: grpc.aio.ServicerContext) -> instance_pb2.CommitMigrateInResponse:
        if not request.HasField("state"):
            raise InvalidArgument("state: required")
        self._check_accepting("migrations")  # shutting down: the source keeps the request rather than hand it here
        await self.inbox.commit(request.migration_id, request_state_from_proto(request.state),
                                 _commit_deadline(context.time_remaining(), request.deadline_unix_ms),
                                 check_accepting=lambda: self._check_accepting("migrations"), attempt=request.attempt)
        return instance_pb2.CommitMigrateInResponse()

    async def AbortMigrateIn(self, request: instance_pb2.AbortMigrateInRequest,
                             context: grpc.aio.ServicerContext) -> instance_pb2.AbortMigrateInResponse:
        if not request.migration_id:
            raise InvalidArgument("migration_id: required")
        was_reserved = await self.inbox.abort(request.migration_id)
        log.info("migration_in_aborted", migration_id=request.migration_id, was_reserved=was_reserved)
        return instance_pb2.AbortMigrateInResponse(was_reserved=was_reserved)

    # Prefill/decode disaggregation.

    async def SetRole(self, request: instance_pb2.SetRoleRequest,
                      context: grpc.aio.ServicerContext) -> instance_pb2.SetRoleResponse:
        """Switch role; a PREFILL instance then moves its decoding requests to decode instances.

        Requests prefilling on an instance that becomes DECODE finish their prefill and decode
        there (moving a half-prefilled request costs as much as finishing it); only new
        Generate calls are refused."""
        role = role_from_proto(request.role)
        # Shielded: a caller whose deadline passes must not leave the role changed here and not in etcd.
        previous, num_moving = await shielded(self._set_role(role))
        log.info("instance_role_changed", instance_id=self.identity.instance_id, previous_role=previous.value,
                 role=role.value, num_moving=num_moving)
        return instance_pb2.SetRoleResponse(instance_id=self.identity.instance_id,
                                            previous_role=role_to_proto(previous), role=role_to_proto(role),
                                            num_moving=num_moving)

    async def _set_role(self, role: InstanceRole) -> tuple[InstanceRole, int]:
        """The previous role, and how many decoding requests now move away. The record goes first (the
        registry queues it for its keepalive while etcd is away); should writing it raise, the role
        stays as it was and the error goes to the caller."""
        async with self.role_lock:  # one change at a time: the etcd record follows the last one
            previous, changed = self.identity.role, replace(self.identity, role=role)
            self._role_being_set = role
            try:
                if self.on_role_change is not None:
                    await self.on_role_change(changed)  # the record first: the role here follows it
                self.identity = changed
            finally:
                self._role_being_set = None
            num_moving = await self.handoff.move_decoding() if role is InstanceRole.PREFILL and self.handoff else 0
        return previous, num_moving

    def on_load_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop whenever the engine's load changes."""
        self._runner.on_load_change = lambda _load: callback()

    def _refuses_as(self, role: InstanceRole) -> bool:
        """Whether this instance refuses the work `role` refuses: its role is that one, and no SetRole to another is
        writing its etcd record (managers that read the new record already send work the new role takes)."""
        return self.identity.role is role and self._role_being_set in (None, role)

    def _check_takes_decodes(self, request_id: str) -> None:
        """A PREFILL instance takes no request to decode by migration (it would decode it, or hand it straight on),
        unless the manager chose it on purpose (`can_decode_on_prefill`: the last decode instance drained)."""
        if self._refuses_as(InstanceRole.PREFILL):
            raise FailedPrecondition(f"instance {self.identity.instance_id} has role prefill and takes no migrations "
                                     f"in (request {request_id}); migrate it to a decode or both instance, or set "
                                     "can_decode_on_prefill when none can take it")

    def _check_accepting(self, what: str) -> None:
        if not self.is_accepting:
            raise Unavailable(f"instance {self.identity.instance_id} is not accepting {what} (draining or shutting down)")
        if self.is_engine_stalled():
            raise Unavailable(f"instance {self.identity.instance_id} is not accepting {what}: its engine step has "
                              "run longer than --engine-stall-timeout-s, or failed (see its log)")

    def load_report(self) -> common_pb2.LoadReport:
        runner = self._runner
        load, num_suspended = runner.load_and_suspended
        num_prefilled = self.handoff.num_prefilled(load.decoding_ids) if self.handoff is not None else 0
        return load_to_proto(self.identity.instance_id, load, runner.num_requests_served, time.time(),
                             runner.step_time_ms_p50, runner.num_steps, num_prefilled=num_prefilled,
                             prefix_cache=runner.prefix_cache_stats,
                             num_incoming_migrations=self.inbox.num_incoming if self.inbox is not None else 0,
                             num_suspended=num_suspended,
                             num_free_migration_out_slots=self.migrations.num_free_slots
                             if self.migrations is not None else None,
                             step_time_ms_token_weighted_p50=runner.step_time_ms_token_weighted_p50,
                             num_preemptions=runner.num_preemptions)


def _commit_deadline(time_remaining: float | None, deadline_unix_ms: int) -> float | None:
    """The earlier of gRPC's deadline and the caller's wall-clock one, on this process's monotonic clock.
    (Clocks apart by more than the caller's timeout would refuse every commit: hosts need NTP.)"""
    now = time.monotonic()
    deadlines = [now + time_remaining] if time_remaining is not None else []
    if deadline_unix_ms > 0:
        deadlines.append(now + deadline_unix_ms / 1000 - time.time())
    return min(deadlines, default=None)


def _is_news(output: StepOutput, from_token_index: int) -> bool:
    """Whether a reader from `from_token_index` on needs `output`: a finish, tokens from there on, or a start
    notice (no token: where the prompt was first computed from, which a resume sends back)."""
    return (output.finish_reason is not None or not output.new_token_ids
            or output.token_index + len(output.new_token_ids) > from_token_index)


def _saying_who_ran_out(exc: ResourceExhausted) -> ResourceExhausted:
    """A MigrateOut's RESOURCE_EXHAUSTED, its trailing metadata naming the party that ran out: a transfer service
    (its staging slots stayed busy) or the destination (no blocks, batch slot or migration slot, or it serves
    shorter sequences than the request may reach)."""
    party = REFUSED_BY_TRANSFER if isinstance(exc, RefusedByTransfer) else REFUSED_BY_DESTINATION
    return ResourceExhausted(exc.message, exc.request_id, trailing_metadata=refused_by_metadata(party))


async def _announce(context: grpc.aio.ServicerContext, request_id: str, migration_id: str) -> None:
    """Name a MigrateOut's picked request and its migration id in the call's initial metadata: a caller whose
    deadline passes (the migration runs on here) reads them from its error and asks the destination whether
    the request arrived under that migration (services/common/pick_announcement.py)."""
    try:
        await context.send_initial_metadata(pick_to_metadata(request_id, migration_id))
    except Exception as exc:  # noqa: BLE001 — the call is over already (cancelled by its deadline): no one to tell
        log.debug("migration_pick_not_announced", request_id=request_id, error=typed_error_text(exc))
