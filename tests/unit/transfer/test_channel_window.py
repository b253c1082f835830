"""The sender and receiver over a channel, in one process: how many chunks are in flight.

The channel is an in-memory stand-in with gloo's matching rule (a send waits until a
receive with its tag takes it). gloo itself runs in tests/integration/test_transfer.py;
this checks the window logic for both kinds of channel, nccl's included (no GPU here).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads
from tests.unit.transfer.factories import random_kv, rows_of, tiny_geometry

pytestmark = pytest.mark.timeout(30)

BLOCK_BYTES = 4 * 64 * 2  # tiny_geometry: 4 rows of 64 fp16 elements
RECEIVE_DELAY_S = 0.003


@dataclass
class FakeChannel:
    backend: TransferBackend
    peer: str = "peer"
    slots: dict[int, queue.Queue] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sends_in_flight: int = 0
    most_sends_in_flight: int = 0
    tags: list[int] = field(default_factory=list)

    @property
    def is_serial(self) -> bool:
        return self.backend is TransferBackend.NCCL

    def send(self, data: torch.Tensor, tag: int, timeout_s: float) -> None:
        with self.lock:
            self.sends_in_flight += 1
            self.most_sends_in_flight = max(self.most_sends_in_flight, self.sends_in_flight)
            self.tags.append(tag)
        taken = threading.Event()
        self._slot(tag).put((data.clone(), taken))
        assert taken.wait(timeout_s), "no receive took the message"
        with self.lock:
            self.sends_in_flight -= 1

    def recv(self, out: torch.Tensor, tag: int, timeout_s: float) -> None:
        time.sleep(RECEIVE_DELAY_S)  # a receiver slower than the gathers: sends that may overlap do
        data, taken = self._slot(tag).get(timeout=timeout_s)
        out.copy_(data)
        taken.set()

    def _slot(self, tag: int) -> queue.Queue:
        with self.lock:
            return self.slots.setdefault(tag, queue.Queue())


class FakeChannels:
    def __init__(self, channel: FakeChannel) -> None:
        self.channel = channel

    async def outgoing(self, peer_address, backend, open_remote):
        return self.channel

    def incoming(self, peer_id, backend):
        return self.channel

    def drop_outgoing(self, peer_address, backend) -> None:
        pass

    def drop_incoming(self, peer_id, backend) -> None:
        pass


class FakeMappings:
    def __init__(self, kvs: dict[str, torch.Tensor], geometry) -> None:
        self.kvs, self.geometry = kvs, geometry

    def rows(self, instance_id):
        return rows_of(self.kvs[instance_id]), self.geometry


class DirectPeer:
    """The destination service: ExpectBlocks goes straight to its receiver."""

    piece_bytes = 1 << 20

    def __init__(self, receiver: BlockReceiver) -> None:
        self.receiver = receiver

    async def expect_blocks(self, header, backend, tag, timeout_s):
        return await self.receiver.receive_on_channel(header, backend, tag, timeout_s)


@pytest.mark.parametrize("backend, buffers, most_in_flight", [
    (TransferBackend.GLOO, 4, 4), (TransferBackend.GLOO, 2, 2), (TransferBackend.NCCL, 4, 1)])
async def test_channel_transfers_keep_their_window_and_land_bit_exactly(backend, buffers, most_in_flight):
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), FakeChannel(backend)
    threads = TransferThreads.start(buffers)
    try:
        receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, buffers), FakeChannels(channel), threads)
        peer = DirectPeer(receiver)
        sender = BlockSender("a", (backend,), mappings, StagingPool(1, BLOCK_BYTES, buffers), FakeChannels(channel),
                             lambda address: peer, threads)
        src_ids, dst_ids = tuple(range(23, -1, -1)), tuple((5 * i) % 24 for i in range(24))  # 24 one-block chunks
        transfer = BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, "b:1", backend, True)
        result = await asyncio.wait_for(sender.transfer(transfer, timeout_s=20), 25)
    finally:
        threads.shutdown()
    assert result.num_bytes == 24 * BLOCK_BYTES
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kvs["dst"][:, :, d], kvs["src"][:, :, s])
    assert channel.most_sends_in_flight <= most_in_flight
    if most_in_flight > 1:  # the receiver keeps all but one buffer posted, so sends overlap
        assert channel.most_sends_in_flight >= 2
    base = channel.tags[0]
    assert sorted(channel.tags) == [base + i for i in range(24)]  # one tag per chunk, consecutive
