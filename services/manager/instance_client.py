"""The manager's calls to instances (the admin ListRequests fan-out, MigrateOut), on pooled channels.

Every call has a deadline; failures come back as ferry errors whose `__cause__` is the
`AioRpcError` (so the migration history can name the exact status, UNIMPLEMENTED included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.common.errors import FerryError, Internal, error_from_rpc
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from services.common.channel_pool import ChannelPool
from services.common.logging import request_metadata
from services.common.pick_announcement import (REFUSED_BY_TRANSFER, AnnouncedPick, is_source_busy, pick_from_metadata,
                                               refused_by)
from services.common.tls import TlsConfig
from services.manager import convert
from services.manager.migration import MigrationFigures, MigrationOrder, SourceBusy, TransferBusy
from services.manager.migration_settle import HeldRequest, SourceUnanswered, SourceUnreached

NEVER_CONNECTED_DETAILS = "failed to connect to all addresses"  # gRPC core's pick failure: the call was never sent
MIGRATE_OUT_PATH = f"/{instance_pb2.DESCRIPTOR.services_by_name['InstanceService'].full_name}/MigrateOut"


class InstanceChannels:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._pool = ChannelPool(tls)

    async def list_requests(self, address: str, timeout_s: float) -> list[instance_pb2.RequestInfo]:
        try:
            async with self._pool.use(address) as channel:
                reply = await instance_pb2_grpc.InstanceServiceStub(channel).ListRequests(
                    instance_pb2.ListRequestsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return list(reply.requests)

    async def held_request(self, address: str, request_id: str, timeout_s: float) -> HeldRequest | None:
        """The request on the instance, unfinished, and how it came there; None if it has none."""
        return next((convert.held_request_from_proto(info) for info in await self.list_requests(address, timeout_s)
                     if info.request_id == request_id and info.state != "finished"), None)

    async def migrate_out(self, order: MigrationOrder, timeout_s: float,
                          on_picked: Callable[[AnnouncedPick], None] = lambda pick: None) -> MigrationFigures:
        """Ask the source to move a request to the destination; returns once committed (or raises). `on_picked` is
        told the source's pick as soon as it announces it, so a caller cancelled before the answer (the manager
        stopping) knows the request and the migration's id too."""
        try:
            async with self._pool.use(order.src_address) as channel:
                call = channel.unary_stream(MIGRATE_OUT_PATH, instance_pb2.MigrateOutRequest.SerializeToString,
                                            instance_pb2.MigrateOutResponse.FromString)(
                    convert.migrate_out_request_to_proto(order), timeout=timeout_s,
                    metadata=request_metadata(order.request_id) or None)
                reply = await _read_announced(call, on_picked)
        except grpc.aio.AioRpcError as exc:
            raise _migrate_out_error(order, exc) from exc
        return convert.migration_figures_from_proto(reply)

    async def set_role(self, address: str, role: int, timeout_s: float) -> instance_pb2.SetRoleResponse:
        """Ask the instance to switch role (it rewrites its etcd record and moves away what no longer fits)."""
        try:
            async with self._pool.use(address) as channel:
                return await instance_pb2_grpc.InstanceServiceStub(channel).SetRole(
                    instance_pb2.SetRoleRequest(role=role), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc

    async def close(self) -> None:
        await self._pool.close()


async def _read_announced(call: grpc.aio.UnaryStreamCall, on_picked: Callable[[AnnouncedPick], None]
                          ) -> instance_pb2.MigrateOutResponse:
    """MigrateOut's one reply, read as a stream: a unary call gets the initial metadata (the pick the source
    announces) only with its answer, a stream as it comes. A caller cancelled meanwhile cancels the call."""
    try:
        pick = pick_from_metadata(await call.initial_metadata())
        if pick.request_id:
            on_picked(pick)
        reply = await call.read()
    except asyncio.CancelledError:
        call.cancel()
        raise
    if reply is grpc.aio.EOF:  # (a source answers once, or fails)
        raise Internal("MigrateOut ended with no answer and no error; is the source a ferry instance?")
    return reply


def _migrate_out_error(order: MigrationOrder, exc: grpc.aio.AioRpcError) -> FerryError:
    """The ferry error of a failed MigrateOut; one the source gave no answer to names the pick it announced."""
    error = error_from_rpc(exc)
    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and is_source_busy(exc.trailing_metadata()):
        return SourceBusy(f"source instance {order.src_instance_id} is busy: {error.message}", order.request_id)
    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and refused_by(exc.trailing_metadata()) == REFUSED_BY_TRANSFER:
        return TransferBusy(error.message, error.request_id or order.request_id)
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return error
    where = f"MigrateOut on source instance {order.src_instance_id} at {order.src_address}"
    if _never_connected(exc):
        return SourceUnreached(f"{where} never reached it, so nothing was migrated: {error.message} (is it "
                               "running? ListInstances shows it unhealthy once its lease ends)",
                               request_id=order.request_id)
    pick = pick_from_metadata(exc.initial_metadata())  # the request to look for on the destination, and how
    return SourceUnanswered(f"{where}: {error.message} (if it is down or frozen, ListInstances shows it unhealthy "
                            "once its lease ends)", request_id=error.request_id or pick.request_id,
                            migration_id=pick.migration_id)


def _never_connected(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the call failed before it was sent: gRPC's picker found no connection to the source (every address
    refused or unreachable), so no initial metadata came either. A call sent on a connection that then broke
    says otherwise ("Socket closed", "Cancelling all calls", ...): the source may have begun it."""
    return (exc.code() is grpc.StatusCode.UNAVAILABLE and not exc.initial_metadata()
            and (exc.details() or "").startswith(NEVER_CONNECTED_DETAILS))
