"""proto ↔ domain for the transfer service (with server.py and client.py, the only modules
that touch generated code)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, transfer_pb2
from services.instance.engine.cuda_ipc import CudaIpcHandle
from services.instance.engine.kv_cache import KvGeometry
from services.transfer.domain import BlockTransfer, IncomingBlocks, InstanceId, TransferBackend, TransferId, TransferResult

_BACKEND_TO_PROTO = {
    TransferBackend.GRPC: transfer_pb2.TRANSFER_BACKEND_GRPC,
    TransferBackend.GLOO: transfer_pb2.TRANSFER_BACKEND_GLOO,
    TransferBackend.NCCL: transfer_pb2.TRANSFER_BACKEND_NCCL,
    TransferBackend.SHM: transfer_pb2.TRANSFER_BACKEND_SHM,
}
_BACKEND_FROM_PROTO = {value: key for key, value in _BACKEND_TO_PROTO.items()}


def backend_to_proto(backend: TransferBackend) -> int:
    return _BACKEND_TO_PROTO[backend]


def backend_from_proto(value: int, default: TransferBackend | None = None) -> TransferBackend:
    if value == transfer_pb2.TRANSFER_BACKEND_UNSPECIFIED and default is not None:
        return default
    if value not in _BACKEND_FROM_PROTO:
        raise InvalidArgument(f"backend: {value} is not one of TRANSFER_BACKEND_GRPC/GLOO/NCCL/SHM")
    return _BACKEND_FROM_PROTO[value]


def geometry_to_proto(geometry: KvGeometry) -> common_pb2.KvGeometry:
    return common_pb2.KvGeometry(
        num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
        block_size=geometry.block_size, num_blocks=geometry.num_blocks, dtype=geometry.dtype_name)


def ipc_handle_to_proto(handle: CudaIpcHandle) -> transfer_pb2.CudaIpcHandle:
    return transfer_pb2.CudaIpcHandle(
        device_uuid=handle.device_uuid, storage_handle=handle.storage_handle,
        storage_size_bytes=handle.storage_size_bytes, storage_offset_bytes=handle.storage_offset_bytes,
        ref_counter_handle=handle.ref_counter_handle, ref_counter_offset=handle.ref_counter_offset,
        event_handle=handle.event_handle, event_sync_required=handle.event_sync_required,
        tensor_offset=handle.tensor_offset)


def ipc_handle_from_proto(msg: transfer_pb2.CudaIpcHandle) -> CudaIpcHandle:
    if not msg.device_uuid or not msg.storage_handle or msg.storage_size_bytes <= 0:
        raise InvalidArgument("cuda_ipc: device_uuid, storage_handle and a positive storage_size_bytes are required")
    if msg.storage_offset_bytes < 0 or msg.tensor_offset < 0 or msg.ref_counter_offset < 0:
        raise InvalidArgument("cuda_ipc: storage_offset_bytes, tensor_offset and ref_counter_offset must be >= 0")
    return CudaIpcHandle(msg.device_uuid, msg.storage_handle, msg.storage_size_bytes, msg.storage_offset_bytes,
                         msg.ref_counter_handle, msg.ref_counter_offset, msg.event_handle, msg.event_sync_required,
                         msg.tensor_offset)


def geometry_from_proto(msg: common_pb2.KvGeometry) -> KvGeometry:
    return KvGeometry.from_dtype_name(
        msg.dtype, num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
        block_size=msg.block_size, num_blocks=msg.num_blocks)


def geometry_from_record(record: dict) -> KvGeometry:
    """The `kv` field of an `instances/<id>` etcd record."""
    fields = {name: int(record[name]) for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks")}
    return KvGeometry.from_dtype_name(record["dtype"], **fields)


def transfer_from_proto(msg: transfer_pb2.TransferRequest, default_backend: TransferBackend) -> BlockTransfer:
    return BlockTransfer(
        src_instance_id=InstanceId(msg.src_instance_id), src_block_ids=tuple(msg.src_block_ids),
        dst_instance_id=InstanceId(msg.dst_instance_id), dst_block_ids=tuple(msg.dst_block_ids),
        dst_transfer_address=msg.dst_transfer_address, backend=backend_from_proto(msg.backend, default_backend),
        is_checksum_verified=msg.verify_checksum, dst_write_grant=msg.dst_write_grant)


def transfer_to_proto(transfer: BlockTransfer) -> transfer_pb2.TransferRequest:
    return transfer_pb2.TransferRequest(
        src_instance_id=transfer.src_instance_id, src_block_ids=transfer.src_block_ids,
        dst_instance_id=transfer.dst_instance_id, dst_block_ids=transfer.dst_block_ids,
        dst_transfer_address=transfer.dst_transfer_address, backend=backend_to_proto(transfer.backend),
        verify_checksum=transfer.is_checksum_verified, dst_write_grant=transfer.dst_write_grant)


def result_to_proto(result: TransferResult) -> transfer_pb2.TransferResponse:
    return transfer_pb2.TransferResponse(num_blocks=result.num_blocks, num_bytes=result.num_bytes,
                                         duration_ms=result.duration_ms, backend=backend_to_proto(result.backend))


def result_from_proto(msg: transfer_pb2.TransferResponse) -> TransferResult:
    return TransferResult(msg.num_blocks, msg.num_bytes, msg.duration_ms, backend_from_proto(msg.backend))


def header_to_proto(header: IncomingBlocks) -> transfer_pb2.BlocksHeader:
    return transfer_pb2.BlocksHeader(
        dst_instance_id=header.dst_instance_id, dst_block_ids=header.dst_block_ids,
        kv=geometry_to_proto(header.geometry), blocks_per_chunk=header.blocks_per_chunk,
        rows_per_chunk=header.rows_per_chunk, checksums=header.checksums, src_transfer_id=header.src_transfer_id,
        in_place_spans=[bound for span in header.in_place_spans for bound in span], write_grant=header.write_grant)


def header_from_proto(msg: transfer_pb2.BlocksHeader) -> IncomingBlocks:
    if not msg.HasField("kv"):
        raise InvalidArgument("header.kv: required (the source's KV geometry)")
    return IncomingBlocks(
        dst_instance_id=InstanceId(msg.dst_instance_id), dst_block_ids=tuple(msg.dst_block_ids),
        geometry=geometry_from_proto(msg.kv), blocks_per_chunk=msg.blocks_per_chunk,
        rows_per_chunk=msg.rows_per_chunk, checksums=tuple(msg.checksums),
        src_transfer_id=TransferId(msg.src_transfer_id), in_place_spans=_spans(msg.in_place_spans),
        write_grant=msg.write_grant)


def _spans(bounds: Sequence[int]) -> tuple[tuple[int, int], ...]:
    if len(bounds) % 2:
        raise InvalidArgument(f"header.in_place_spans: {len(bounds)} bounds; give [start, stop) pairs")
    return tuple(zip(bounds[::2], bounds[1::2]))


# -- ReceiveBlocks data messages, without protobuf copies ------------------------------------
# A data message is `ReceiveBlocksRequest(data=...)`: one tag byte, a varint length, the bytes.
# Encoding joins the parts once (straight from KV memory); decoding slices the received
# message. Both stay wire-compatible with the proto (grpcurl and other clients just work).

_DATA_TAG = 2 << 3 | 2  # field 2 (data), wire type 2 (length-delimited)


def encode_data_message(*parts: bytes | memoryview) -> bytes:
    """`ReceiveBlocksRequest(data=b"".join(parts))` in wire format, built with one copy of the parts."""
    num_bytes = sum(memoryview(part).nbytes for part in parts)
    return b"".join((bytes([_DATA_TAG]), _varint(num_bytes), *parts))


def decode_receive_blocks_message(message: bytes) -> transfer_pb2.ReceiveBlocksRequest | memoryview:
    """A data message as a view of its bytes (no copy); anything else (the header) parsed."""
    if message[:1] == bytes([_DATA_TAG]):
        length, offset = _read_varint(message, 1)
        if offset + length == len(message):
            return memoryview(message)[offset:]
    return transfer_pb2.ReceiveBlocksRequest.FromString(message)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, offset: int) -> tuple[int, int]:
    """(value, offset after it); a truncated varint reads as a length that does not fit."""
    value = shift = 0
    for index in range(offset, min(offset + 10, len(data))):
        value |= (data[index] & 0x7F) << shift
        shift += 7
        if data[index] < 0x80:
            return value, index + 1
    return -1, len(data)
