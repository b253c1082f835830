"""Typed async client of another instance's migration RPCs (the source calls the destination).

Pooled channels by address (`InstanceClients`); every call has a deadline and
failures come back as ferry errors (a peer that is down or misses the deadline is
Unavailable).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from services.common.errors import error_from_rpc
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from services.common.channel_pool import ChannelPool
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.instance.convert import request_state_to_proto, reservation_from_proto
from services.instance.engine.migration_state import RequestState
from services.instance.migration_domain import Reservation


class InstanceClient:
    def __init__(self, pool: ChannelPool, address: str, timeout_s: float) -> None:
        self._pool = pool
        self._address = address
        self._timeout_s = timeout_s

    async def prepare_migrate_in(self, migration_id: str, request_id: str, src_instance_id: str,
                                 num_blocks: int, grow_only: bool = False,
                                 block_hashes: Sequence[bytes] = (), timeout_s: float | None = None,
                                 keep_cached_blocks: int | None = None, max_num_tokens: int = 0,
                                 can_decode_on_prefill: bool = False,
                                 num_leading_blocks_not_held: int = 0) -> Reservation:
        """`timeout_s`: a deadline shorter than the client's own, for this call only."""
        request = instance_pb2.PrepareMigrateInRequest(migration_id=migration_id, request_id=request_id,
                                                       src_instance_id=src_instance_id, num_blocks=num_blocks,
                                                       grow_only=grow_only, block_hashes=list(block_hashes),
                                                       keep_cached_blocks=keep_cached_blocks,
                                                       max_num_tokens=max_num_tokens,
                                                       can_decode_on_prefill=can_decode_on_prefill,
                                                       num_leading_blocks_not_held=num_leading_blocks_not_held)
        return reservation_from_proto(await self._call("PrepareMigrateIn", request, request_id, timeout_s))

    async def commit_migrate_in(self, migration_id: str, state: RequestState, attempt: int = 0) -> None:
        request = instance_pb2.CommitMigrateInRequest(migration_id=migration_id, state=request_state_to_proto(state),
                                                      deadline_unix_ms=int((time.time() + self._timeout_s) * 1000),
                                                      attempt=attempt)
        await self._call("CommitMigrateIn", request, state.request_id)

    async def abort_migrate_in(self, migration_id: str) -> bool:
        reply = await self._call("AbortMigrateIn", instance_pb2.AbortMigrateInRequest(migration_id=migration_id))
        return reply.was_reserved

    async def _call(self, method: str, request, request_id: str | None = None, timeout_s: float | None = None):
        timeout_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        try:
            async with self._pool.use(self._address) as channel:
                call = getattr(instance_pb2_grpc.InstanceServiceStub(channel), method)
                return await call(request, timeout=timeout_s, metadata=request_metadata(request_id) or None)
        except grpc.aio.AioRpcError as exc:  # gRPC's words ("Socket closed") do not say who
            raise error_from_rpc(exc, peer=f"the destination instance at {self._address}") from None


class InstanceClients:
    """A client of the instance at an address, on the pool's channel to it."""

    def __init__(self, timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._timeout_s = timeout_s
        self._pool = ChannelPool(tls)

    def __call__(self, address: str) -> InstanceClient:
        return InstanceClient(self._pool, address, self._timeout_s)

    async def close(self) -> None:
        await self._pool.close()
