"""The manager's calls to instances (the admin ListRequests fan-out), one cached channel per address."""

from __future__ import annotations

import grpc

from services.common.errors import error_from_rpc
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc
from services.common.grpc_server import insecure_channel


class InstanceChannels:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def list_requests(self, address: str, timeout_s: float) -> list[instance_pb2.RequestInfo]:
        stub = instance_pb2_grpc.InstanceServiceStub(self._channel(address))
        try:
            reply = await stub.ListRequests(instance_pb2.ListRequestsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return list(reply.requests)

    async def keep_only(self, addresses: set[str]) -> None:
        """Close the channels of instances that are gone."""
        for address in set(self._channels) - addresses:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        await self.keep_only(set())

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = insecure_channel(address)
        return self._channels[address]
