"""Typed async client of the leader manager's PD calls (ManagerService/PlaceDecode, ReportMigration).

The leader's address comes from the etcd leader view, read at every call; channels are
pooled by address, so a leader change never closes a channel under calls still on it
(that cancelled them, and a PD hand-off worker with them). Every call has a deadline; failures come back as ferry errors (no leader,
a leader that is down or misses the deadline: Unavailable).
"""

from __future__ import annotations

import time
from collections.abc import Collection

import grpc

from services.common.election import LeaderView
from services.common.errors import FerryError, ResourceExhausted, Unavailable, error_from_rpc
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.common.channel_pool import ChannelPool
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.common.pick_announcement import REFUSED_BY_DESTINATION, REFUSED_BY_TRANSFER
from services.instance.migration_domain import MigrateOutPlan, MigrationResult, RefusedByTransfer
from services.instance.pd_handoff import DecodePlace


PLACE_DECODE_TIMEOUT_S = 1.0  # a leader answers in milliseconds; past this the request decodes here


class ManagerLink:
    def __init__(self, leader_view: LeaderView, timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._leader_view = leader_view
        self._timeout_s = timeout_s
        self._pool = ChannelPool(tls)

    async def place_decode(self, request_id: str, src_instance_id: str, num_blocks: int,
                           refused: Collection[str] = (), max_num_tokens: int = 0) -> DecodePlace:
        request = manager_pb2.PlaceDecodeRequest(request_id=request_id, src_instance_id=src_instance_id,
                                                 num_blocks=num_blocks, exclude_instance_ids=sorted(refused),
                                                 max_num_tokens=max_num_tokens)
        # A short deadline: the request waits parked at its first token meanwhile, and so does every
        # one queued behind it (a frozen leader cost each of them the whole RPC timeout).
        reply = await self._call("PlaceDecode", request, request_id, min(self._timeout_s, PLACE_DECODE_TIMEOUT_S))
        return DecodePlace(reply.instance_id, reply.address)

    async def report_migration(self, result: MigrationResult, started_at: float) -> None:
        record = manager_pb2.MigrationRecord(
            request_id=result.request_id, src_instance_id=result.src_instance_id,
            dst_instance_id=result.dst_instance_id, num_blocks=result.num_blocks, num_bytes=result.num_bytes,
            num_stages=result.num_stages, backend=result.backend.value, duration_ms=result.duration_ms,
            downtime_ms=result.downtime_ms, num_cached_at_destination=result.num_cached_at_destination,
            outcome="committed", trigger="pd", started_at=started_at)
        await self._call("ReportMigration", record, result.request_id)

    async def report_failed_migration(self, plan: MigrateOutPlan, src_instance_id: str, error: FerryError,
                                      started_at: float) -> None:
        """A hand-off that did not happen (the request decodes on the source), for ListMigrations."""
        record = manager_pb2.MigrationRecord(
            request_id=plan.request_id, src_instance_id=src_instance_id, dst_instance_id=plan.dst_instance_id,
            duration_ms=max(0.0, (time.time() - started_at) * 1e3), outcome="failed",
            reason=error.grpc_code.name, message=error.message, trigger="pd", started_at=started_at,
            refused_by=_refused_by(error))
        await self._call("ReportMigration", record, plan.request_id)

    async def close(self) -> None:
        await self._pool.close()

    async def _call(self, method: str, request, request_id: str, timeout_s: float | None = None):
        try:
            async with self._pool.use(self._leader_address()) as channel:
                return await getattr(manager_pb2_grpc.ManagerServiceStub(channel), method)(
                    request, timeout=timeout_s or self._timeout_s, metadata=request_metadata(request_id) or None)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    def _leader_address(self) -> str:
        leader = self._leader_view.leader
        if leader is None or not leader.address:
            raise Unavailable("no leader manager is known (etcd manager/leader is empty); start a manager")
        return leader.address


def _refused_by(error: FerryError) -> str:
    """Which party ran out, for a RESOURCE_EXHAUSTED (pick_announcement.py's words); "" for other errors."""
    if not isinstance(error, ResourceExhausted):
        return ""
    return REFUSED_BY_TRANSFER if isinstance(error, RefusedByTransfer) else REFUSED_BY_DESTINATION
