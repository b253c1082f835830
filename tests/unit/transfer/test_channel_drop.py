"""A sender that drops its gloo channel (real groups, in one process) ends its own blocked sends at once.

gloo's send waits until the peer receives it, and letting go of the group does not wake it: the
send holds the connection open itself. A channel dropped because the receiver never took the
transfer (its ExpectBlocks failed before it posted a receive) left the sends, and the staging slot
they held, waiting for the whole transfer deadline.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.common.errors import Unavailable
from services.common.task_errors import read_error
from services.transfer.channels import ChannelTable
from services.transfer.pair_channel import PairChannel
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.receiver import BlockReceiver
from services.transfer import sender as sender_module
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads
from tests.unit.transfer.factories import random_kv, tiny_geometry
from tests.unit.transfer.test_channel_window import BLOCK_BYTES, FakeMappings
from tests.unit.transfer.test_unretrieved_errors import Peer

pytestmark = pytest.mark.timeout(60)
DEADLINE_S = 20.0


class PeerThatNeverReceives:
    """Joins the channel, but its ExpectBlocks fails before it posts a receive (the call did not get
    through, or the peer refused the request before looking at the channel)."""

    piece_bytes = 1 << 20

    def __init__(self, table: ChannelTable, expect_delay_s: float = 0.0) -> None:
        self.table = table
        self.expect_delay_s = expect_delay_s

    async def open_channel(self, peer_transfer_id, store_address, rank, backend, num_connections, timeout_s,
                           channel_id=0, incarnation=0):
        await self.table.accept(peer_transfer_id, backend, store_address, rank, num_connections,
                                channel_id=channel_id)

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        await asyncio.sleep(self.expect_delay_s)
        raise Unavailable("the transfer service at b:1 did not answer: connection reset")


@pytest.fixture
def gloo_pair():
    threads = TransferThreads.start(4)
    sender_table = ChannelTable("A", "127.0.0.1", 10, threads.io, gloo_connections=2)
    receiver_table = ChannelTable("B", "127.0.0.1", 10, threads.io)
    yield threads, sender_table, receiver_table
    sender_table.close()
    receiver_table.close()
    threads.shutdown()


def _sender(threads, table: ChannelTable, peer, in_place_min_row_bytes: int = 0) -> tuple[BlockSender, BlockTransfer]:
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    sender = BlockSender("A", (TransferBackend.GLOO,), FakeMappings(kvs, geometry), StagingPool(1, BLOCK_BYTES, 4),
                         table, lambda address: peer, threads, in_place_min_row_bytes=in_place_min_row_bytes)
    ids = tuple(range(12))
    return sender, BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False)


async def test_a_transfer_whose_expect_blocks_failed_fails_at_once_not_at_its_deadline(gloo_pair):
    threads, sender_table, receiver_table = gloo_pair
    sender, transfer = _sender(threads, sender_table, PeerThatNeverReceives(receiver_table, expect_delay_s=0.5))
    started = time.monotonic()
    with pytest.raises(Unavailable, match="did not answer"):
        await sender.transfer(transfer, DEADLINE_S)
    assert time.monotonic() - started < 5, "the sends waited for the deadline after the channel was dropped"
    assert sender_table.num_channels == 0


@pytest.mark.parametrize("in_place_min_row_bytes", [0, 1], ids=["staged", "in_place"])
async def test_a_cancelled_transfer_whose_peer_does_not_receive_ends_at_once(gloo_pair, in_place_min_row_bytes):
    """In place, the rows' sends block an io thread the cancelled transfer waits for: it drops the channel
    first (which ends them), as a staged transfer does before it waits for its sends."""
    threads, sender_table, receiver_table = gloo_pair
    sender, transfer = _sender(threads, sender_table, PeerThatNeverReceives(receiver_table, expect_delay_s=60),
                               in_place_min_row_bytes)
    task = asyncio.ensure_future(sender.transfer(transfer, DEADLINE_S))
    await asyncio.sleep(1.0)  # the channel is open and the first sends are blocked
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 5, "the cancelled transfer's sends waited for the deadline"
    assert sender_table.num_channels == 0


class PeerThatDroppedItsEnd:
    """Joins the channel, then drops its end before the transfer's ExpectBlocks reaches it (another
    transfer on the channel failed there: the receiver drops its end to wake the blocked sender)."""

    piece_bytes = 1 << 20

    def __init__(self, table: ChannelTable, threads: TransferThreads) -> None:
        self.table = table
        self.receiver = BlockReceiver(None, StagingPool(1, BLOCK_BYTES, 4), table, threads)

    async def open_channel(self, peer_transfer_id, store_address, rank, backend, num_connections, timeout_s,
                           channel_id=0, incarnation=0):
        await self.table.accept(peer_transfer_id, backend, store_address, rank, num_connections,
                                channel_id=channel_id)

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        self.table.drop_incoming(header.src_transfer_id, backend)
        return await self.receiver.receive_on_channel(header, backend, tag, timeout_s, channel_id)


async def test_a_channel_the_receiver_dropped_mid_transfer_is_unavailable_and_reopened_on_retry(gloo_pair):
    """The receiver answered FAILED_PRECONDITION ("the sender must call OpenChannel first"), which a
    migration takes for a refusal (Aborted: the copy was refused) rather than a retryable break."""
    threads, sender_table, receiver_table = gloo_pair
    sender, transfer = _sender(threads, sender_table, PeerThatDroppedItsEnd(receiver_table, threads))
    with pytest.raises(Unavailable, match="no gloo channel from transfer service 'A'"):
        await sender.transfer(transfer, DEADLINE_S)
    assert sender_table.num_channels == 0  # the retry opens afresh


class ReceivingPeer(Peer):
    """The destination service on real gloo, each ExpectBlocks a call of its own."""

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        # A call of its own, as over gRPC: a caller that gives up cancels it and goes, leaving it to end.
        call = asyncio.ensure_future(self.receiver.receive_on_channel(header, backend, tag, timeout_s, channel_id))
        call.add_done_callback(read_error)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.cancel()
            raise


@pytest.mark.parametrize("how", ["dropped", "retired"])
async def test_a_transfer_whose_channel_was_replaced_while_it_waited_posts_nothing_on_the_new_one(gloo_pair, how):
    """A transfer took the channel, then waited for a staging slot; meanwhile another transfer's failure
    dropped that channel (or etcd said the peer left: retired, it closes once unused) and the next transfer
    opened a fresh one, which the receiver took in its place. The waiting transfer's ExpectBlocks then
    posted its receives on the fresh channel, where no message of its ever comes: they held the
    receiver's slot until its deadline and then broke the fresh channel."""
    threads, sender_table, receiver_table = gloo_pair
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings = FakeMappings(kvs, geometry)
    receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4), receiver_table, threads)
    peer = ReceivingPeer(receiver_table, receiver)
    send_staging = StagingPool(1, BLOCK_BYTES, 4)
    sender = BlockSender("A", (TransferBackend.GLOO,), mappings, send_staging, sender_table, lambda address: peer,
                         threads, in_place_min_row_bytes=0)
    ids = tuple(range(12))
    first = BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False)
    async with send_staging.slot(1):  # another transfer's
        waiting = asyncio.ensure_future(sender.transfer(first, DEADLINE_S))
        while not sender_table.num_channels:
            await asyncio.sleep(0.01)  # it took the channel and waits for the slot
        if how == "dropped":
            sender_table.drop_outgoing("b:1", TransferBackend.GLOO)  # another transfer on it failed
        else:
            sender_table.close_outgoing("b:1")  # the peer's record left etcd (its lease lapsed while it stalled)
        await sender_table.outgoing("b:1", TransferBackend.GLOO, _opening(peer))
    with pytest.raises(Unavailable):
        await asyncio.wait_for(waiting, 5)
    later_ids = tuple(range(12, 24))
    later = BlockTransfer(InstanceId("src"), later_ids, InstanceId("dst"), later_ids, "b:1", TransferBackend.GLOO,
                          False)
    started = time.monotonic()
    await asyncio.wait_for(sender.transfer(later, DEADLINE_S), DEADLINE_S + 5)
    assert time.monotonic() - started < 5, "the next transfer waited for the receives left on the fresh channel"
    assert torch.equal(kvs["dst"][:, :, 12:], kvs["src"][:, :, 12:])


async def test_a_transfer_in_flight_on_a_retired_channel_completes_when_a_fresh_one_is_opened(gloo_pair):
    """etcd said the peer left (its lease lapsed while it stalled) during a transfer to it: the channel is
    retired, closing once that transfer ends, and the next transfer opens a fresh one. The receiver took the
    fresh channel in place of the old one and dropped it at once, under the transfer still on it, which failed."""
    threads, sender_table, receiver_table = gloo_pair
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings = FakeMappings(kvs, geometry)
    receive_staging = StagingPool(2, BLOCK_BYTES, 4)
    receive_threads = TransferThreads.start(8)  # its own, as in a service of its own: the sends block the sender's
    peer = ReceivingPeer(receiver_table, BlockReceiver(mappings, receive_staging, receiver_table, receive_threads))
    sender = BlockSender("A", (TransferBackend.GLOO,), mappings, StagingPool(2, BLOCK_BYTES, 4), sender_table,
                         lambda address: peer, threads, in_place_min_row_bytes=0)

    def transfer(ids: tuple[int, ...]) -> BlockTransfer:
        return BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False)
    async with receive_staging.slot(1), receive_staging.slot(1):  # the receiver is busy: the first waits, on its channel
        first = asyncio.ensure_future(sender.transfer(transfer(tuple(range(12))), DEADLINE_S))
        while not (old := _incoming_in_use(receiver_table)):
            await asyncio.sleep(0.01)
        assert sender_table.close_outgoing("b:1") == 1  # retired: the first transfer still uses it
        second = asyncio.ensure_future(sender.transfer(transfer(tuple(range(12, 24))), DEADLINE_S))
        while _incoming_in_use(receiver_table) in (None, old):
            await asyncio.sleep(0.01)  # the second opened a fresh channel and its receive waits for a slot too
    try:
        await asyncio.wait_for(asyncio.gather(first, second), DEADLINE_S)
    finally:
        receive_threads.shutdown()
    assert torch.equal(kvs["dst"], kvs["src"])


def _opening(peer: ReceivingPeer):
    """`ChannelTable.outgoing`'s open_remote, as BlockSender makes it for sender "A"."""
    async def open_remote(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
        await peer.open_channel("A", store_address, rank, TransferBackend.GLOO, num_connections, 5, channel_id)
    return open_remote


def _incoming_in_use(table: ChannelTable) -> PairChannel | None:
    """The channel from "A" if a receive has taken it."""
    channel = table.incoming("A", TransferBackend.GLOO) if table.num_channels else None
    return channel if channel is not None and channel.num_transfers else None


class PeerWhoseFirstExpectArrivesLate(ReceivingPeer):
    """The first ExpectBlocks reaches the receiver only once `arrive` is set: it was on its way when the
    sender's channel was replaced by a fresh one, whose OpenChannel overtook it."""

    def __init__(self, table: ChannelTable, receiver: BlockReceiver) -> None:
        super().__init__(table, receiver)
        self.sent, self.arrive = asyncio.Event(), asyncio.Event()

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        if not self.sent.is_set():
            self.sent.set()
            await self.arrive.wait()
        return await super().expect_blocks(header, backend, tag, timeout_s, channel_id)


async def test_an_expect_blocks_that_arrives_after_its_channel_was_replaced_is_refused_at_once(gloo_pair, monkeypatch):
    """A transfer sent its ExpectBlocks; then its channel was dropped (another transfer on it failed) and the
    next transfer opened a fresh one, whose OpenChannel reached the receiver first. The late ExpectBlocks
    posted its receives on the fresh channel, where no message of its ever comes: they held the receiver's
    slot until the deadline (and then broke the fresh channel). It names its channel now, and is refused."""
    monkeypatch.setattr(sender_module, "PEER_ANSWER_GRACE_S", 10.0)  # the sender waits for the answer meanwhile
    threads, sender_table, receiver_table = gloo_pair
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings = FakeMappings(kvs, geometry)
    receive_threads = TransferThreads.start(8)
    peer = PeerWhoseFirstExpectArrivesLate(receiver_table, BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4),
                                                                         receiver_table, receive_threads))
    sender = BlockSender("A", (TransferBackend.GLOO,), mappings, StagingPool(2, BLOCK_BYTES, 4), sender_table,
                         lambda address: peer, threads, in_place_min_row_bytes=0)

    def transfer(ids: tuple[int, ...]) -> BlockTransfer:
        return BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False)
    try:
        first = asyncio.ensure_future(sender.transfer(transfer(tuple(range(12))), DEADLINE_S))
        await asyncio.wait_for(peer.sent.wait(), 5)
        sender_table.drop_outgoing("b:1", TransferBackend.GLOO)  # another transfer on it failed
        await sender_table.outgoing("b:1", TransferBackend.GLOO, _opening(peer))
        peer.arrive.set()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(first, 5)
        started = time.monotonic()
        await asyncio.wait_for(sender.transfer(transfer(tuple(range(12, 24))), DEADLINE_S), DEADLINE_S + 5)
        assert time.monotonic() - started < 5, "the next transfer waited for the receives left on the fresh channel"
    finally:
        receive_threads.shutdown()
    assert torch.equal(kvs["dst"][:, :, 12:], kvs["src"][:, :, 12:])


async def test_the_receiver_takes_the_channel_named_or_any_from_an_older_sender_that_names_none(gloo_pair):
    _threads, sender_table, receiver_table = gloo_pair
    peer = ReceivingPeer(receiver_table, None)
    channel = await sender_table.outgoing("b:1", TransferBackend.GLOO, _opening(peer))
    assert channel.channel_id and receiver_table.incoming("A", TransferBackend.GLOO, channel.channel_id).channel_id \
        == channel.channel_id
    assert receiver_table.incoming("A", TransferBackend.GLOO).channel_id == channel.channel_id  # 0: not named
    with pytest.raises(Unavailable, match="replaced by a newer one"):
        receiver_table.incoming("A", TransferBackend.GLOO, channel.channel_id + 1)
