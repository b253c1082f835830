"""gRPC servicer of a transfer service: thin, proto → domain → sender/receiver → proto."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import transfer_pb2, transfer_pb2_grpc
from services.transfer.metrics import observed_transfer
from services.transfer.channels import ChannelTable
from services.transfer.convert import (backend_from_proto, backend_to_proto, geometry_from_proto, header_from_proto,
                                       result_to_proto, transfer_from_proto)
from services.transfer.domain import InstanceId, TransferBackend
from services.transfer.kv_mappings import KvMappings
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender

log = structlog.get_logger(__name__)

MappingsChanged = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class TransferNode:
    """Everything a servicer call needs, built once the server knows its address."""

    transfer_id: str
    address: str
    backends: tuple[TransferBackend, ...]
    default_backend: TransferBackend
    max_timeout_s: float
    mappings: KvMappings
    sender: BlockSender
    receiver: BlockReceiver
    channels: ChannelTable
    on_mappings_changed: MappingsChanged


class TransferServicer(transfer_pb2_grpc.TransferServiceServicer):
    def __init__(self) -> None:
        self.node: TransferNode | None = None  # set before the server reports SERVING

    async def MapInstance(self, request: transfer_pb2.MapInstanceRequest,
                          context: grpc.aio.ServicerContext) -> transfer_pb2.MapInstanceResponse:
        if not request.instance_id or not request.shm_name or not request.HasField("kv"):
            raise InvalidArgument("instance_id, shm_name and kv: all required")
        cache = self.node.mappings.map(InstanceId(request.instance_id), request.shm_name, geometry_from_proto(request.kv))
        await self.node.on_mappings_changed()
        return transfer_pb2.MapInstanceResponse(transfer_id=self.node.transfer_id, num_bytes=cache.geometry.num_bytes)

    async def UnmapInstance(self, request: transfer_pb2.UnmapInstanceRequest,
                            context: grpc.aio.ServicerContext) -> transfer_pb2.UnmapInstanceResponse:
        was_mapped = self.node.mappings.unmap(InstanceId(request.instance_id))
        if was_mapped:
            await self.node.on_mappings_changed()
        return transfer_pb2.UnmapInstanceResponse(was_mapped=was_mapped)

    async def Transfer(self, request: transfer_pb2.TransferRequest,
                       context: grpc.aio.ServicerContext) -> transfer_pb2.TransferResponse:
        transfer = transfer_from_proto(request, self.node.default_backend)
        with observed_transfer(transfer.backend.value) as moved:
            result = await self.node.sender.transfer(transfer, self._timeout_s(context))
            moved.append(result.num_bytes)
        return result_to_proto(result)

    async def ReceiveBlocks(self, request_iterator: AsyncIterator[transfer_pb2.ReceiveBlocksRequest],
                            context: grpc.aio.ServicerContext) -> transfer_pb2.ReceiveBlocksResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("ReceiveBlocks: the first message must carry the header")
        header = header_from_proto(first.header)
        num_bytes = await self.node.receiver.receive_pieces(header, _data(request_iterator), self._timeout_s(context))
        return transfer_pb2.ReceiveBlocksResponse(num_blocks=len(header.dst_block_ids), num_bytes=num_bytes)

    async def OpenChannel(self, request: transfer_pb2.OpenChannelRequest,
                          context: grpc.aio.ServicerContext) -> transfer_pb2.OpenChannelResponse:
        if not request.peer_transfer_id or not request.store_address:
            raise InvalidArgument("peer_transfer_id and store_address: both required")
        await self.node.channels.accept(request.peer_transfer_id, backend_from_proto(request.backend),
                                        request.store_address, request.rank)
        return transfer_pb2.OpenChannelResponse()

    async def ExpectBlocks(self, request: transfer_pb2.ExpectBlocksRequest,
                           context: grpc.aio.ServicerContext) -> transfer_pb2.ExpectBlocksResponse:
        header = header_from_proto(request.header)
        num_bytes = await self.node.receiver.receive_on_channel(
            header, backend_from_proto(request.backend), request.tag, self._timeout_s(context))
        return transfer_pb2.ExpectBlocksResponse(num_blocks=len(header.dst_block_ids), num_bytes=num_bytes)

    async def GetStatus(self, request: transfer_pb2.GetTransferStatusRequest,
                        context: grpc.aio.ServicerContext) -> transfer_pb2.GetTransferStatusResponse:
        node = self.node
        return transfer_pb2.GetTransferStatusResponse(
            transfer_id=node.transfer_id, address=node.address, backends=[backend_to_proto(b) for b in node.backends],
            instance_ids=node.mappings.instance_ids(), pid=os.getpid())

    def _timeout_s(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.node.max_timeout_s if remaining is None else min(remaining, self.node.max_timeout_s)


async def _data(request_iterator: AsyncIterator[transfer_pb2.ReceiveBlocksRequest]) -> AsyncIterator[bytes]:
    async for message in request_iterator:
        if not message.HasField("data"):
            raise InvalidArgument("ReceiveBlocks: only the first message may carry a header")
        yield message.data
