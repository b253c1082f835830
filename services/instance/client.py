"""Typed async client of another instance's migration RPCs (the source calls the destination).

One cached channel per address (`InstanceClients`); every call has a deadline and
failures come back as ferry errors (a peer that is down or misses the deadline is
Unavailable).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.errors import error_from_rpc
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.instance.convert import request_state_to_proto, reservation_from_proto
from services.instance.engine.migration_state import RequestState
from services.instance.migration import Reservation


class InstanceClient:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, address: str = "") -> None:
        self._stub = instance_pb2_grpc.InstanceServiceStub(channel)
        self._timeout_s = timeout_s
        self._address = address

    async def prepare_migrate_in(self, migration_id: str, request_id: str, src_instance_id: str,
                                 num_blocks: int, grow_only: bool = False,
                                 block_hashes: Sequence[bytes] = ()) -> Reservation:
        request = instance_pb2.PrepareMigrateInRequest(migration_id=migration_id, request_id=request_id,
                                                       src_instance_id=src_instance_id, num_blocks=num_blocks,
                                                       grow_only=grow_only, block_hashes=list(block_hashes))
        return reservation_from_proto(await self._call(self._stub.PrepareMigrateIn, request, request_id))

    async def commit_migrate_in(self, migration_id: str, state: RequestState) -> None:
        request = instance_pb2.CommitMigrateInRequest(migration_id=migration_id, state=request_state_to_proto(state))
        await self._call(self._stub.CommitMigrateIn, request, state.request_id)

    async def abort_migrate_in(self, migration_id: str) -> bool:
        reply = await self._call(self._stub.AbortMigrateIn, instance_pb2.AbortMigrateInRequest(migration_id=migration_id))
        return reply.was_reserved

    async def abort(self, request_id: str) -> bool:
        reply = await self._call(self._stub.Abort, instance_pb2.AbortRequest(request_id=request_id), request_id)
        return reply.was_running

    async def _call(self, method, request, request_id: str | None = None, metadata: Sequence = ()):
        try:
            return await method(request, timeout=self._timeout_s, metadata=request_metadata(request_id) or None)
        except grpc.aio.AioRpcError as exc:  # gRPC's words ("Socket closed") do not say who
            raise error_from_rpc(exc, peer=f"the destination instance at {self._address}") from None


class InstanceClients:
    """One client per destination address, on one cached channel each."""

    def __init__(self, timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._timeout_s = timeout_s
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __call__(self, address: str) -> InstanceClient:
        if address not in self._channels:
            self._channels[address] = secure_or_insecure_channel(address, self._tls)
        return InstanceClient(self._channels[address], self._timeout_s, address)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
