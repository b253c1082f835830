"""Typed async client of a transfer service (ferry.v1.TransferService).

Instances call `map_instance` once and `transfer` per migration stage; transfer services
call each other through `receive_blocks`, `open_channel` and `expect_blocks` (the
`PeerTransferService` protocol). Every call has a deadline; failures come back as ferry
errors (`services.common.errors`): a peer that died or missed the deadline is Unavailable.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import structlog

from services.common.idle_table import IdleClosingTable, Usage
from services.common.errors import FerryError, NotFound, Unavailable, error_from_rpc
from services.common.gen.ferry.v1 import transfer_pb2, transfer_pb2_grpc
from services.common.grpc_server import BULK_TRANSFER_OPTIONS, secure_or_insecure_channel
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.instance.engine.cuda_ipc import CudaIpcHandle
from services.instance.engine.kv_cache import KvGeometry
from services.transfer.convert import (backend_from_proto, backend_to_proto, geometry_to_proto, header_to_proto,
                                       ipc_handle_to_proto, result_from_proto, transfer_to_proto)
from services.transfer.domain import (DEFAULT_PIECE_BYTES, IDLE_CLOSE_S, BlockTransfer, IncomingBlocks,
                                      TransferBackend, TransferResult)
from services.common.peer_address import peer_key

log = structlog.get_logger(__name__)

RECEIVE_BLOCKS_METHOD = "/ferry.v1.TransferService/ReceiveBlocks"


class TransferClient:
    def __init__(self, address: str, timeout_s: float = 5.0, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 tls: TlsConfig | None = None, usage: Usage | None = None) -> None:
        self.address = address
        self.usage = usage or Usage()  # its calls under way: TransferClients never closes a client while one is
        self._peer = f"the transfer service at {address}"  # how errors name it
        self._timeout_s = timeout_s
        self.piece_bytes = piece_bytes  # the most data bytes per ReceiveBlocks message (senders chunk by it)
        self._channel = secure_or_insecure_channel(address, tls, BULK_TRANSFER_OPTIONS)
        self._stub = transfer_pb2_grpc.TransferServiceStub(self._channel)
        # ReceiveBlocks with data messages the sender encoded (convert.encode_data_message).
        self._receive_blocks = self._channel.stream_unary(
            RECEIVE_BLOCKS_METHOD, request_serializer=_serialize_piece,
            response_deserializer=transfer_pb2.ReceiveBlocksResponse.FromString)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> TransferClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- for instances ---------------------------------------------------------------

    async def map_instance(self, instance_id: str, shm_name: str, geometry: KvGeometry,
                           cuda_ipc: CudaIpcHandle | None = None) -> int:
        """Map the instance's KV: the shared memory `shm_name`, or (KV on a GPU) the `cuda_ipc` allocation."""
        request = transfer_pb2.MapInstanceRequest(
            instance_id=instance_id, shm_name=shm_name, kv=geometry_to_proto(geometry),
            cuda_ipc=ipc_handle_to_proto(cuda_ipc) if cuda_ipc is not None else None)
        return (await self._call(self._stub.MapInstance, request)).num_bytes

    async def unmap_instance(self, instance_id: str) -> bool:
        reply = await self._call(self._stub.UnmapInstance, transfer_pb2.UnmapInstanceRequest(instance_id=instance_id))
        return reply.was_mapped

    async def transfer(self, transfer: BlockTransfer, timeout_s: float, request_id: str | None = None) -> TransferResult:
        """Copy the blocks; returns only once all landed. `timeout_s` bounds the whole copy."""
        reply = await self._call(self._stub.Transfer, transfer_to_proto(transfer), timeout_s,
                                 request_metadata(request_id))
        return result_from_proto(reply)

    async def grant_writes(self, instance_id: str, write_grant: int, timeout_s: float | None = None) -> None:
        await self._call(self._stub.GrantWrites,
                         transfer_pb2.GrantWritesRequest(instance_id=instance_id, write_grant=write_grant), timeout_s)

    async def revoke_writes(self, instance_id: str, write_grant: int, timeout_s: float | None = None) -> bool:
        """True once no write under the grant can land any more (False: it was not granted there)."""
        request = transfer_pb2.RevokeWritesRequest(instance_id=instance_id, write_grant=write_grant)
        return (await self._call(self._stub.RevokeWrites, request, timeout_s)).was_granted

    async def get_status(self, timeout_s: float | None = None) -> transfer_pb2.GetTransferStatusResponse:
        return await self._call(self._stub.GetStatus, transfer_pb2.GetTransferStatusRequest(), timeout_s)

    async def backends(self) -> list[TransferBackend]:
        return [backend_from_proto(b) for b in (await self.get_status()).backends]

    # -- PeerTransferService ---------------------------------------------------------

    async def receive_blocks(self, header: IncomingBlocks, messages: AsyncIterator[bytes], timeout_s: float) -> int:
        with self.usage.call():
            try:
                reply = await self._receive_blocks(_with_header(header, messages), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if not _is_failed_write(exc):
                    raise error_from_rpc(exc, peer=self._peer) from None
                raise await self._why_the_stream_broke(header) from None
        return reply.num_bytes

    async def _why_the_stream_broke(self, header: IncomingBlocks) -> FerryError:
        """The destination ended the stream while we wrote, and gRPC lost its status: ask it whether it
        maps the destination instance (the usual early refusal); otherwise, or if it does not answer, it died."""
        try:
            status = await self.get_status(_WHY_TIMEOUT_S)
        except FerryError:
            status = None
        if status is not None and header.dst_instance_id not in status.instance_ids:
            return NotFound(f"instance {header.dst_instance_id!r} is not mapped by transfer service "
                            f"{status.transfer_id!r}; the destination refused the blocks")
        return Unavailable("the stream to the destination transfer service broke while sending blocks (it died, "
                           "or ended the call early); retry")

    async def open_channel(self, peer_transfer_id: str, store_address: str, rank: int, backend: TransferBackend,
                           num_connections: int, timeout_s: float, channel_id: int, incarnation: int = 0) -> int:
        request = transfer_pb2.OpenChannelRequest(peer_transfer_id=peer_transfer_id, store_address=store_address,
                                                  rank=rank, backend=backend_to_proto(backend),
                                                  num_connections=num_connections, channel_id=channel_id,
                                                  peer_incarnation=incarnation)
        return (await self._call(self._stub.OpenChannel, request, timeout_s)).incarnation

    async def expect_blocks(self, header: IncomingBlocks, backend: TransferBackend, tag: int, timeout_s: float,
                            channel_id: int) -> int:
        request = transfer_pb2.ExpectBlocksRequest(header=header_to_proto(header), backend=backend_to_proto(backend),
                                                   tag=tag, channel_id=channel_id)
        return (await self._call(self._stub.ExpectBlocks, request, timeout_s)).num_bytes

    async def _call(self, method, request, timeout_s: float | None = None, metadata: Sequence = ()):
        with self.usage.call():
            try:
                return await method(request, timeout=timeout_s or self._timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, peer=self._peer) from None


async def _with_header(header: IncomingBlocks, messages: AsyncIterator[bytes]):
    yield transfer_pb2.ReceiveBlocksRequest(header=header_to_proto(header))
    async for message in messages:
        yield message


def _serialize_piece(message: transfer_pb2.ReceiveBlocksRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class TransferClients:
    """One cached client per peer address (the sender's `PeerFactory`).

    A peer that restarts comes back under a new address (the default port is 0), so clients are not
    kept for ever: one neither taken nor called for `idle_close_s` is closed when a new address is
    taken, and past MAX_ENTRIES (4096) addresses the least recently used ones close early. One with a
    call under way never is; so a caller takes its client for each call and keeps none between calls
    (the sender does), and a client closed meanwhile is made afresh on the next take. A peer known to be
    gone (it left etcd, or restarted: `PeerWatch`) has its clients closed at once (`close_peer`), under every
    spelling of its address."""

    def __init__(self, piece_bytes: int = DEFAULT_PIECE_BYTES, tls: TlsConfig | None = None,
                 idle_close_s: float = IDLE_CLOSE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._piece_bytes = piece_bytes
        self._tls = tls
        self._table: IdleClosingTable[TransferClient] = IdleClosingTable(TransferClient.close, "peer_client",
                                                                         idle_close_s, clock)

    def __call__(self, address: str) -> TransferClient:
        return self._table.take(address, lambda usage: TransferClient(
            address, piece_bytes=self._piece_bytes, tls=self._tls, usage=usage)).value

    @property
    def addresses(self) -> list[str]:
        return self._table.addresses

    def close_peer(self, address: str) -> int:
        """Close the clients of a peer that is gone (at once, or when their calls under way end), one per spelling
        of its address (`peer_key`: each dials the address as given); how many."""
        key = peer_key(address)
        spellings = [spelled for spelled in self._table.addresses if peer_key(spelled) == key]
        return sum(self._table.close_address(spelled, "peer_gone") for spelled in spellings)

    async def close(self) -> None:
        await self._table.close()


# What grpc's asyncio client reports when a write fails because the stream already ended (the
# peer died, or ended the call early), instead of the stream's own status: grpc/grpc#36066.
_FAILED_WRITE_DETAILS = "Internal error from Core"


_WHY_TIMEOUT_S = 2.0  # for the question that follows such a failure


def _is_failed_write(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() is grpc.StatusCode.INTERNAL and exc.details() == _FAILED_WRITE_DETAILS

