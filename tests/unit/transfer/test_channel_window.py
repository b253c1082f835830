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

from services.transfer.pair_channel import PairChannel
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.write_grants import WriteGrants
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
    in_order_batches: int = 0
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_transfers: int = 0
    channel_id: int = 0
    close_when_unused = None
    transfer_turn = PairChannel.transfer_turn
    in_use = PairChannel.in_use

    @property
    def is_serial(self) -> bool:
        return self.backend is TransferBackend.NCCL

    @property
    def moves_in_place(self) -> bool:
        return self.backend is TransferBackend.GLOO

    def check_open(self) -> None:
        pass  # never dropped

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

    def send_in_order(self, messages, timeout_s: float) -> None:
        self.in_order_batches += 1
        for data, tag in messages:
            self.send(data, tag, timeout_s)

    def recv_in_order(self, messages, timeout_s: float) -> None:
        for out, tag in messages:
            self.recv(out, tag, timeout_s)

    def _slot(self, tag: int) -> queue.Queue:
        with self.lock:
            return self.slots.setdefault(tag, queue.Queue())


class FakeChannels:
    incarnation = 0  # this process's life, named in the opens (ChannelTable's)

    def __init__(self, channel: FakeChannel) -> None:
        self.channel = channel

    async def outgoing(self, peer_address, backend, open_remote, timeout_s=None):
        return self.channel

    def incoming(self, peer_id, backend, channel_id=0):
        return self.channel

    def drop_outgoing(self, peer_address, backend, only=None) -> None:
        pass

    def drop_incoming(self, peer_id, backend, only=None) -> None:
        pass


class FakeMappings:
    def __init__(self, kvs: dict[str, torch.Tensor], geometry) -> None:
        self.kvs, self.geometry = kvs, geometry
        self.write_grants = WriteGrants()

    def rows(self, instance_id):
        return rows_of(self.kvs[instance_id]), self.geometry


class DirectPeer:
    """The destination service: ExpectBlocks goes straight to its receiver."""

    piece_bytes = 1 << 20

    def __init__(self, receiver: BlockReceiver) -> None:
        self.receiver = receiver

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        return await self.receiver.receive_on_channel(header, backend, tag, timeout_s, channel_id)


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


class NcclLikeChannel(FakeChannel):
    """NCCL's matching rule: no tags, the n-th receive takes the n-th send."""

    def _slot(self, tag: int) -> queue.Queue:
        return super()._slot(0)


async def test_two_nccl_transfers_at_once_on_one_channel_each_land_in_their_own_blocks():
    """Two staging slots let two transfers to one peer run at once. NCCL pairs sends and receives in
    the order they are posted, whatever the tags: before, their chunks landed in each other's
    blocks and both reported success. The channel now takes one transfer at a time."""
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src1": random_kv(geometry, 1), "src2": random_kv(geometry, 2),
           "dst1": torch.zeros(geometry.shape, dtype=geometry.dtype),
           "dst2": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), NcclLikeChannel(TransferBackend.NCCL)
    threads = TransferThreads.start(4)
    try:
        receiver = BlockReceiver(mappings, StagingPool(2, BLOCK_BYTES, 2), FakeChannels(channel), threads)
        peer = DirectPeer(receiver)
        sender = BlockSender("a", (TransferBackend.NCCL,), mappings, StagingPool(2, BLOCK_BYTES, 2),
                             FakeChannels(channel), lambda address: peer, threads)
        ids = tuple(range(12))
        transfers = [BlockTransfer(InstanceId(f"src{k}"), ids, InstanceId(f"dst{k}"), ids, "b:1", TransferBackend.NCCL,
                                   False) for k in (1, 2)]
        for _ in range(4):  # the interleaving varies: before, some rounds happened to come out right
            for k in (1, 2):
                kvs[f"dst{k}"].zero_()
            await asyncio.wait_for(asyncio.gather(*(sender.transfer(t, 20) for t in transfers)), 25)
            for k in (1, 2):
                assert torch.equal(kvs[f"dst{k}"][:, :, list(ids)], kvs[f"src{k}"][:, :, list(ids)])
    finally:
        threads.shutdown()


class RecordingChannel(FakeChannel):
    """Also records the memory each send read and each receive wrote."""

    def __init__(self, backend: TransferBackend) -> None:
        super().__init__(backend)
        self.send_ptrs: list[int] = []
        self.recv_ptrs: list[int] = []

    def send(self, data: torch.Tensor, tag: int, timeout_s: float) -> None:
        with self.lock:
            self.send_ptrs.append(data.data_ptr())
        super().send(data, tag, timeout_s)

    def recv(self, out: torch.Tensor, tag: int, timeout_s: float) -> None:
        with self.lock:
            self.recv_ptrs.append(out.data_ptr())
        super().recv(out, tag, timeout_s)


def _inside(ptr: int, tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() <= ptr < tensor.data_ptr() + tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("backend, expect_in_place", [(TransferBackend.GLOO, True), (TransferBackend.NCCL, False)])
async def test_spans_consecutive_on_both_sides_move_in_place_on_gloo(backend, expect_in_place):
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 2), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), RecordingChannel(backend)
    threads = TransferThreads.start(4)
    try:
        receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), threads)
        peer = DirectPeer(receiver)
        sender = BlockSender("a", (backend,), mappings, StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel),
                             lambda address: peer, threads, in_place_min_row_bytes=256)  # rows of 2+ blocks
        # Runs on both sides: 6 blocks (cut into spans of 4 and 2: a row of a span must fit the
        # 512-byte staging buffer), two single blocks (staged), then 3 blocks.
        src_ids = (3, 4, 5, 6, 7, 8, 20, 1, 10, 11, 12)
        dst_ids = (10, 11, 12, 13, 14, 15, 2, 0, 5, 6, 7)
        transfer = BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, "b:1", backend, True)
        result = await asyncio.wait_for(sender.transfer(transfer, timeout_s=20), 25)
    finally:
        threads.shutdown()
    assert result.num_bytes == len(src_ids) * BLOCK_BYTES
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kvs["dst"][:, :, d], kvs["src"][:, :, s])
    num_chunks = 3 * 4 + 2 if expect_in_place else len(src_ids)  # a chunk per span row and per staged block
    assert len(channel.send_ptrs) == len(channel.recv_ptrs) == num_chunks
    assert sum(_inside(ptr, kvs["src"]) for ptr in channel.send_ptrs) == (12 if expect_in_place else 0)
    assert sum(_inside(ptr, kvs["dst"]) for ptr in channel.recv_ptrs) == (12 if expect_in_place else 0)
    assert bool(channel.in_order_batches) == expect_in_place  # spans go from one thread, in order


async def test_nccl_chunks_go_through_the_nccl_staging_pools_where_a_service_has_them():
    """On a GPU host the service stages nccl chunks in pools on the nccl device (so nothing
    bounces through host memory); here two host pools stand in for them: every nccl send reads,
    and every receive writes, one of their buffers, and never the host pools'."""
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 4), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), RecordingChannel(TransferBackend.NCCL)
    send_pool, receive_pool = StagingPool(1, BLOCK_BYTES, 2), StagingPool(1, BLOCK_BYTES, 2)
    threads = TransferThreads.start(4)
    try:
        receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), threads,
                                 nccl_staging=receive_pool)
        peer = DirectPeer(receiver)
        sender = BlockSender("a", (TransferBackend.NCCL,), mappings, StagingPool(1, BLOCK_BYTES, 4),
                             FakeChannels(channel), lambda address: peer, threads, nccl_staging=send_pool)
        src_ids, dst_ids = (3, 9, 4, 0, 17), (1, 2, 22, 8, 5)
        transfer = BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, "b:1",
                                 TransferBackend.NCCL, True)
        await asyncio.wait_for(sender.transfer(transfer, timeout_s=20), 25)
    finally:
        threads.shutdown()
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kvs["dst"][:, :, d], kvs["src"][:, :, s])
    send_buffers = [b for slot in send_pool.slots for b in slot.buffers]
    receive_buffers = [b for slot in receive_pool.slots for b in slot.buffers]
    assert len(channel.send_ptrs) == len(channel.recv_ptrs) == len(src_ids)
    assert all(any(_inside(ptr, b) for b in send_buffers) for ptr in channel.send_ptrs)
    assert all(any(_inside(ptr, b) for b in receive_buffers) for ptr in channel.recv_ptrs)


@pytest.mark.parametrize("in_place_side", ["src", "dst"])
async def test_a_span_consecutive_on_one_side_moves_in_place_there_and_stages_on_the_other(in_place_side):
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 3), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), RecordingChannel(TransferBackend.GLOO)
    threads = TransferThreads.start(4)
    run, scattered = (4, 5, 6, 7), (20, 2, 9, 14)
    src_ids, dst_ids = (run, scattered) if in_place_side == "src" else (scattered, run)
    try:
        receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), threads)
        peer = DirectPeer(receiver)
        sender = BlockSender("a", (TransferBackend.GLOO,), mappings, StagingPool(1, BLOCK_BYTES, 4),
                             FakeChannels(channel), lambda address: peer, threads, in_place_min_row_bytes=256)
        transfer = BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, "b:1", TransferBackend.GLOO,
                                 True)
        await asyncio.wait_for(sender.transfer(transfer, timeout_s=20), 25)
    finally:
        threads.shutdown()
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kvs["dst"][:, :, d], kvs["src"][:, :, s])
    assert len(channel.send_ptrs) == 4  # one span of 4 blocks, row by row
    assert sum(_inside(ptr, kvs["src"]) for ptr in channel.send_ptrs) == (4 if in_place_side == "src" else 0)
    assert sum(_inside(ptr, kvs["dst"]) for ptr in channel.recv_ptrs) == (4 if in_place_side == "dst" else 0)


class ChannelsByPeer:
    def __init__(self, channels: dict[str, FakeChannel]) -> None:
        self.channels = channels

    async def outgoing(self, peer_address, backend, open_remote, timeout_s=None):
        return self.channels[peer_address]

    def incoming(self, peer_id, backend, channel_id=0):
        raise AssertionError("the sender's table is not asked for incoming channels")

    def drop_outgoing(self, peer_address, backend, only=None) -> None:
        pass


class LatePeer(DirectPeer):
    """A busy destination: its receive starts `delay_s` late."""

    def __init__(self, receiver: BlockReceiver, delay_s: float) -> None:
        super().__init__(receiver)
        self.delay_s = delay_s

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        await asyncio.sleep(self.delay_s)
        return await super().expect_blocks(header, backend, tag, timeout_s, channel_id)


async def test_an_nccl_transfer_waiting_for_a_busy_peer_holds_no_slot_another_peer_needs():
    """Two transfers queued for busy peer b held both nccl staging slots (one only waiting for b's turn),
    so a transfer to idle peer c waited about a second behind them. The turn now comes before the slot."""
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings = FakeMappings(kvs, geometry)
    channels = {address: FakeChannel(TransferBackend.NCCL, address) for address in ("b:1", "c:1")}
    threads = TransferThreads.start(8)
    try:
        peers = {address: LatePeer(BlockReceiver(mappings, StagingPool(2, BLOCK_BYTES, 2), FakeChannels(channel),
                                                 threads), 1.0 if address == "b:1" else 0.0)
                 for address, channel in channels.items()}
        sender = BlockSender("a", (TransferBackend.NCCL,), mappings, StagingPool(1, BLOCK_BYTES, 4),
                             ChannelsByPeer(channels), lambda address: peers[address], threads,
                             nccl_staging=StagingPool(2, BLOCK_BYTES, 2))

        def transfer(address: str, ids: tuple[int, ...]) -> asyncio.Future:
            return asyncio.ensure_future(sender.transfer(BlockTransfer(
                InstanceId("src"), ids, InstanceId("dst"), ids, address, TransferBackend.NCCL, False), 20))
        to_b = [transfer("b:1", (1, 2)), transfer("b:1", (3, 4))]
        await asyncio.sleep(0.1)
        started = asyncio.get_running_loop().time()
        await transfer("c:1", (5, 6))
        assert asyncio.get_running_loop().time() - started < 0.5
        await asyncio.gather(*to_b)
    finally:
        threads.shutdown()
