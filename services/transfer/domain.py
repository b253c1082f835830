"""Transfer domain types: backends, ids, what one transfer asks for and what it did."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass
from typing import NewType

from services.common.errors import InvalidArgument
from services.instance.engine.kv_cache import KvGeometry

InstanceId = NewType("InstanceId", str)
TransferId = NewType("TransferId", str)
# One process life of a transfer service: random, chosen at its start, in its etcd record and every OpenChannel it
# sends or answers, so a channel knows which life of its peer joined it (0: unknown, a peer from before).
Incarnation = NewType("Incarnation", int)


def new_incarnation() -> Incarnation:
    return Incarnation(secrets.randbits(63) + 1)


class TransferBackend(enum.Enum):
    GRPC = "grpc"  # ReceiveBlocks stream between transfer services; works everywhere
    GLOO = "gloo"  # torch.distributed gloo send/recv on a per-pair process group
    NCCL = "nccl"  # the same with NCCL on CUDA
    SHM = "shm"  # both instances mapped here: a direct memory copy


CHANNEL_BACKENDS = (TransferBackend.GLOO, TransferBackend.NCCL)
# Data bytes per grpc message (--grpc-piece-kib): ~1 MiB moved as fast as 8 MiB once freed heap
# is kept (common/heap.py), and holds less memory per message in flight.
DEFAULT_PIECE_BYTES = 1 << 20
# A peer's channel (ChannelTable) or client (TransferClients) unused this long is closed (the app raises it to
# at least 4 x --transfer-timeout-s): peers that restart come back under new addresses.
IDLE_CLOSE_S = 600.0


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One Transfer call: copy `src_block_ids[i]` of src into `dst_block_ids[i]` of dst."""

    src_instance_id: InstanceId
    src_block_ids: tuple[int, ...]
    dst_instance_id: InstanceId
    dst_block_ids: tuple[int, ...]
    dst_transfer_address: str  # the transfer service mapping dst ("" with SHM)
    backend: TransferBackend
    is_checksum_verified: bool
    dst_write_grant: int = 0  # the destination's write grant for dst_block_ids (0 = unfenced)

    def __post_init__(self) -> None:
        if not self.src_block_ids:
            raise InvalidArgument("src_block_ids: must not be empty")
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise InvalidArgument(f"dst_block_ids: {len(self.dst_block_ids)} ids for "
                                  f"{len(self.src_block_ids)} src_block_ids; give one destination per block")
        if self.backend is not TransferBackend.SHM and not self.dst_transfer_address:
            raise InvalidArgument(f"dst_transfer_address: required with backend {self.backend.value}")

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True, slots=True)
class TransferResult:
    num_blocks: int
    num_bytes: int
    duration_ms: float
    backend: TransferBackend


@dataclass(frozen=True, slots=True)
class IncomingBlocks:
    """The header of a block stream: where the blocks go and how the bytes are laid out."""

    dst_instance_id: InstanceId
    dst_block_ids: tuple[int, ...]
    geometry: KvGeometry  # the source's; all but num_blocks must match the destination's
    blocks_per_chunk: int
    rows_per_chunk: int
    checksums: tuple[int, ...]  # crc32 per block; empty = unchecked
    src_transfer_id: TransferId
    in_place_spans: tuple[tuple[int, int], ...] = ()  # [start, stop) of blocks that travel row by row
    write_grant: int = 0  # the destination's write grant (0 = unfenced)

    def __post_init__(self) -> None:
        if not self.dst_block_ids:
            raise InvalidArgument("header.dst_block_ids: must not be empty")
        if self.checksums and len(self.checksums) != len(self.dst_block_ids):
            raise InvalidArgument(f"header.checksums: {len(self.checksums)} for {len(self.dst_block_ids)} blocks")
        if self.blocks_per_chunk <= 0 or self.rows_per_chunk <= 0:
            raise InvalidArgument("header.blocks_per_chunk and header.rows_per_chunk: must be positive")


@dataclass(frozen=True, slots=True)
class MappedInstance:
    instance_id: InstanceId
    shm_name: str
    geometry: KvGeometry
