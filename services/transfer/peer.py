"""What the sender needs from the destination's transfer service (TransferClient provides it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from services.transfer.domain import IncomingBlocks, TransferBackend


class PeerTransferService(Protocol):
    piece_bytes: int  # the most data bytes one ReceiveBlocks message carries: the grpc chunk size

    async def receive_blocks(self, header: IncomingBlocks, messages: AsyncIterator[bytes], timeout_s: float) -> int:
        """Stream the header, then the data messages (`convert.encode_data_message`, one per chunk,
        at most `piece_bytes` of data each); returns bytes received."""

    async def open_channel(self, peer_transfer_id: str, store_address: str, rank: int, backend: TransferBackend,
                           num_connections: int, timeout_s: float, channel_id: int, incarnation: int = 0) -> int:
        """Ask the peer to join the pair group whose TCPStore is at `store_address`, named `channel_id`;
        `incarnation`: our life. Returns the peer's life (0: unknown)."""

    async def expect_blocks(self, header: IncomingBlocks, backend: TransferBackend, tag: int, timeout_s: float,
                            channel_id: int) -> int:
        """Ask the peer to receive the blocks on the channel `channel_id` from us; returns when all landed."""


# dst_transfer_address → a (cached) client. Take it for each call, keep none between calls: a cached client with
# no call under way may be closed (TransferClients' bound), and a fresh one is made on the next take.
PeerFactory = Callable[[str], PeerTransferService]
