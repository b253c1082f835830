"""gRPC servicer of a transfer service: thin, proto → domain → sender/receiver → proto."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog

from services.common.errors import FerryError, InvalidArgument, Unavailable
from services.common.gen.ferry.v1 import transfer_pb2, transfer_pb2_grpc
from services.transfer.metrics import observed_transfer
from services.transfer.channels import ChannelTable
from services.transfer.pair_channel import MAX_GLOO_CONNECTIONS, MAX_TAG, TAG_STRIDE
from services.transfer.convert import (backend_from_proto, backend_to_proto, decode_receive_blocks_message,
                                       geometry_from_proto, header_from_proto, ipc_handle_from_proto, result_to_proto,
                                       transfer_from_proto)
from services.transfer.domain import InstanceId, TransferBackend
from services.transfer.kv_mappings import KvMappings
from services.transfer.deadline import Deadline
from services.transfer.receiver import MAX_DISCARD_BYTES, BlockReceiver, CountedPieces, discard_pieces
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
        cuda_ipc = ipc_handle_from_proto(request.cuda_ipc) if request.HasField("cuda_ipc") else None
        cache = self.node.mappings.map(InstanceId(request.instance_id), request.shm_name,
                                       geometry_from_proto(request.kv), cuda_ipc)
        await self.node.on_mappings_changed()
        return transfer_pb2.MapInstanceResponse(transfer_id=self.node.transfer_id, num_bytes=cache.geometry.num_bytes)

    async def UnmapInstance(self, request: transfer_pb2.UnmapInstanceRequest,
                            context: grpc.aio.ServicerContext) -> transfer_pb2.UnmapInstanceResponse:
        if not request.instance_id:
            raise InvalidArgument("instance_id: required")
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

    async def ReceiveBlocks(self, request_iterator: AsyncIterator[transfer_pb2.ReceiveBlocksRequest | memoryview],
                            context: grpc.aio.ServicerContext) -> transfer_pb2.ReceiveBlocksResponse:
        """Registered by `add_transfer_servicer`: data messages arrive as views of their bytes."""
        first = await anext(aiter(request_iterator), None)
        try:
            if not isinstance(first, transfer_pb2.ReceiveBlocksRequest) or not first.HasField("header"):
                raise InvalidArgument("ReceiveBlocks: the first message must carry the header")
            header = header_from_proto(first.header)
        except FerryError:  # a header this side cannot read (a newer sender): its size is not known either
            await discard_pieces(CountedPieces(_data(request_iterator)), MAX_DISCARD_BYTES,
                                 Deadline.after(self._timeout_s(context)))
            raise
        num_bytes = await self.node.receiver.receive_pieces(header, _data(request_iterator), self._timeout_s(context))
        return transfer_pb2.ReceiveBlocksResponse(num_blocks=len(header.dst_block_ids), num_bytes=num_bytes)

    async def OpenChannel(self, request: transfer_pb2.OpenChannelRequest,
                          context: grpc.aio.ServicerContext) -> transfer_pb2.OpenChannelResponse:
        if not request.peer_transfer_id or not request.store_address:
            raise InvalidArgument("peer_transfer_id and store_address: both required")
        _check_host_port("store_address", request.store_address)
        if request.rank not in (0, 1):
            raise InvalidArgument(f"rank: must be 0 or 1 (a pair group), got {request.rank}")
        if not 0 <= request.num_connections <= MAX_GLOO_CONNECTIONS:
            raise InvalidArgument(f"num_connections: must be 0..{MAX_GLOO_CONNECTIONS}, got {request.num_connections}")
        await self.node.channels.accept(request.peer_transfer_id, backend_from_proto(request.backend),
                                        request.store_address, request.rank, max(1, request.num_connections),
                                        self._timeout_s(context), request.channel_id, request.peer_incarnation)
        return transfer_pb2.OpenChannelResponse(incarnation=self.node.channels.incarnation)

    async def ExpectBlocks(self, request: transfer_pb2.ExpectBlocksRequest,
                           context: grpc.aio.ServicerContext) -> transfer_pb2.ExpectBlocksResponse:
        if not 0 <= request.tag <= MAX_TAG:
            raise InvalidArgument(f"tag: must be 0..{MAX_TAG} (chunk tags add up to {TAG_STRIDE - 1}), got {request.tag}")
        header = header_from_proto(request.header)
        num_bytes = await self.node.receiver.receive_on_channel(
            header, backend_from_proto(request.backend), request.tag, self._timeout_s(context), request.channel_id)
        return transfer_pb2.ExpectBlocksResponse(num_blocks=len(header.dst_block_ids), num_bytes=num_bytes)

    async def GrantWrites(self, request: transfer_pb2.GrantWritesRequest,
                          context: grpc.aio.ServicerContext) -> transfer_pb2.GrantWritesResponse:
        if not request.instance_id:
            raise InvalidArgument("instance_id: required")
        self.node.mappings.get(InstanceId(request.instance_id))  # NotFound unless mapped here
        if (remaining := context.time_remaining()) is not None and remaining <= 0:
            raise Unavailable("GrantWrites arrived after its deadline: the caller gave up, so it opens nothing")
        self.node.mappings.write_grants.grant(InstanceId(request.instance_id), request.write_grant)
        return transfer_pb2.GrantWritesResponse()

    async def RevokeWrites(self, request: transfer_pb2.RevokeWritesRequest,
                           context: grpc.aio.ServicerContext) -> transfer_pb2.RevokeWritesResponse:
        if not request.instance_id:
            raise InvalidArgument("instance_id: required")
        timeout_s = self._timeout_s(context)
        try:
            async with asyncio.timeout(timeout_s):
                was_granted = await self.node.mappings.write_grants.revoke(InstanceId(request.instance_id),
                                                                           request.write_grant)
        except TimeoutError:
            raise Unavailable(f"a write under grant {request.write_grant} is still under way after {timeout_s:.3g} s; "
                              "it is refused from its next chunk on: ask again") from None
        return transfer_pb2.RevokeWritesResponse(was_granted=was_granted)

    async def GetStatus(self, request: transfer_pb2.GetTransferStatusRequest,
                        context: grpc.aio.ServicerContext) -> transfer_pb2.GetTransferStatusResponse:
        node = self.node
        return transfer_pb2.GetTransferStatusResponse(
            transfer_id=node.transfer_id, address=node.address, backends=[backend_to_proto(b) for b in node.backends],
            instance_ids=node.mappings.instance_ids(), pid=os.getpid(), num_write_grants=len(node.mappings.write_grants))

    def _timeout_s(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.node.max_timeout_s if remaining is None else min(remaining, self.node.max_timeout_s)


def add_transfer_servicer(servicer: TransferServicer, server: grpc.aio.Server) -> None:
    """`add_TransferServiceServicer_to_server`, except that ReceiveBlocks decodes its data
    messages as views of the received bytes (no protobuf parse, no copy)."""
    service = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(transfer_pb2, method.input_type.name)
        response_type = getattr(transfer_pb2, method.output_type.name)
        deserialize = decode_receive_blocks_message if method.name == "ReceiveBlocks" else request_type.FromString
        handler = grpc.stream_unary_rpc_method_handler if method.client_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = handler(getattr(servicer, method.name), request_deserializer=deserialize,
                                        response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _check_host_port(name: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{name}: expected host:port, got {address[:80]!r}")


async def _data(request_iterator: AsyncIterator[transfer_pb2.ReceiveBlocksRequest | memoryview]
                ) -> AsyncIterator[memoryview]:
    async for message in request_iterator:
        if isinstance(message, memoryview):
            yield message
        elif message.HasField("data"):  # encoded by another client, with extra fields
            yield memoryview(message.data)
        else:
            raise InvalidArgument("ReceiveBlocks: only the first message may carry a header")
