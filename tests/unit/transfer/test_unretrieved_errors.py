"""A gloo channel that breaks mid-transfer leaves no failed future or task unobserved.

Real gloo groups in one process: the sender's end is dropped (closing its connections, as a
dead peer's would) while sends and receives are in flight on both sides. Every future a
transfer started must have its error retrieved, or asyncio logs "Future exception was never
retrieved" (with a traceback) when the garbage collector finds it, a screenful per broken channel.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from services.common.errors import Unavailable
from services.common.etcd_launcher import free_port
from services.transfer.channels import ChannelTable
from services.transfer.domain import BlockTransfer, IncomingBlocks, InstanceId, TransferBackend
from services.transfer.pipeline import ScatterBehind
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads, run_in_thread
from tests.unit.transfer.factories import random_kv, tiny_geometry
from tests.unit.transfer.test_channel_window import BLOCK_BYTES, FakeChannel, FakeChannels, FakeMappings

pytestmark = pytest.mark.timeout(60)
BREAK_AFTER_SCATTERS = 4


class ReceiverThatSignals(BlockReceiver):
    """Sets `scattered` once BREAK_AFTER_SCATTERS chunks have landed, and scatters nothing more until `resume`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scattered, self.resume = threading.Event(), threading.Event()
        self.num_scattered = 0

    def _scatter_behind(self, target, slot) -> ScatterBehind:
        scatter_behind = super()._scatter_behind(target, slot)
        scatter = scatter_behind._scatter

        def scatter_and_signal(chunk, staged) -> None:
            scatter(chunk, staged)
            self.num_scattered += 1
            if self.num_scattered == BREAK_AFTER_SCATTERS:
                self.scattered.set()
                self.resume.wait(10)
        scatter_behind._scatter = scatter_and_signal
        return scatter_behind


class Peer:
    piece_bytes = 1 << 20

    def __init__(self, table: ChannelTable, receiver: BlockReceiver) -> None:
        self.table, self.receiver = table, receiver

    async def open_channel(self, peer_transfer_id, store_address, rank, backend, num_connections, timeout_s,
                           channel_id=0, incarnation=0):
        await self.table.accept(peer_transfer_id, backend, store_address, rank, num_connections,
                                channel_id=channel_id)

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        return await self.receiver.receive_on_channel(header, backend, tag, timeout_s, channel_id)


@pytest.mark.parametrize("in_place", [False, True])
async def test_a_channel_broken_mid_transfer_leaves_no_error_unretrieved(in_place):
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    threads = TransferThreads.start(4)
    sender_table = ChannelTable("A", "127.0.0.1", 10, threads.rendezvous, gloo_connections=2)
    receiver_table = ChannelTable("B", "127.0.0.1", 10, threads.rendezvous)
    try:
        geometry = tiny_geometry(num_blocks=48)
        kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
        mappings = FakeMappings(kvs, geometry)
        receiver = ReceiverThatSignals(mappings, StagingPool(1, BLOCK_BYTES, 4), receiver_table, threads)
        sender = BlockSender("A", (TransferBackend.GLOO,), mappings, StagingPool(1, BLOCK_BYTES, 4), sender_table,
                             lambda address: Peer(receiver_table, receiver), threads,
                             in_place_min_row_bytes=256 if in_place else 0)
        # Staged: 48 one-block chunks. In place: consecutive on the source only, so the sender moves
        # spans of 4 blocks row by row from one thread and the receiver stages them.
        src_ids, dst_ids = tuple(range(48)), tuple(range(47, -1, -1))
        transfer = asyncio.ensure_future(sender.transfer(
            BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, "b:1", TransferBackend.GLOO, False),
            20))
        assert await asyncio.to_thread(receiver.scattered.wait, 10)
        sender_table.drop_outgoing("b:1", TransferBackend.GLOO)  # its connections close, as a dead peer's would
        receiver.resume.set()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(transfer, 20)
        del transfer  # its error's traceback holds the transfer's frames
        await _collect_garbage()
    finally:
        receiver.resume.set()
        sender_table.close()
        receiver_table.close()
        threads.shutdown()
        gc.collect()
    assert _messages(unretrieved) == []


class ChannelWhoseSendsBlock(FakeChannel):
    """gloo's rule, but every send waits for `release` and then raises `error()`."""

    def __init__(self, error: Callable[[], BaseException]) -> None:
        super().__init__(TransferBackend.GLOO)
        self.error, self.release = error, threading.Event()

    def send(self, data, tag, timeout_s) -> None:
        self.release.wait(timeout_s)
        raise self.error()


class PeerThatRefusesAtOnce:
    piece_bytes = 1 << 20

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        raise Unavailable("the transfer service at b:1 did not answer: connection reset")


async def _collect_garbage() -> None:
    """Collect what the failed transfer left (a future's finalizer reports an error nobody read)."""
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.05)


def _messages(unretrieved: list[dict[str, Any]]) -> list[str]:
    return [f"{context['message']}: {context.get('exception')!r}" for context in unretrieved]


@pytest.mark.parametrize("ending", ["cancelled", "bug"])
async def test_a_transfer_that_ends_without_reading_its_peers_answer_leaves_it_retrieved(ending):
    """The peer answered (an error) while the sends still waited; then the transfer was cancelled, or a
    send failed with an error that is not a broken channel. Its ExpectBlocks task was left failed, unread."""
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    channel = ChannelWhoseSendsBlock(lambda: Unavailable("gloo send to b:1 failed") if ending == "cancelled"
                                     else ValueError("a bug"))
    threads = TransferThreads.start(4)
    try:
        sender = BlockSender("A", (TransferBackend.GLOO,), FakeMappings(kvs, geometry),
                             StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), lambda address: PeerThatRefusesAtOnce(),
                             threads, in_place_min_row_bytes=0)
        ids = tuple(range(12))
        transfer = asyncio.ensure_future(sender.transfer(
            BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False), 20))
        await asyncio.sleep(0.3)  # the peer has answered; the sends wait
        if ending == "cancelled":
            transfer.cancel()
        channel.release.set()
        await asyncio.wait([transfer], timeout=10)
        assert transfer.cancelled() if ending == "cancelled" else isinstance(transfer.exception(), ValueError)
        del transfer  # its error's traceback holds the transfer's frames
    finally:
        channel.release.set()
        threads.shutdown()
    await _collect_garbage()
    assert _messages(unretrieved) == []


def _fails_after(delay_s: float) -> None:
    time.sleep(delay_s)
    raise Unavailable("gloo receive from D failed: connection reset by peer")


async def test_a_thread_whose_waiter_was_cancelled_leaves_its_error_retrieved():
    """A receiver's RPC is cancelled when its sender dies; the in-place receive it waited for (on an io
    thread) then failed with nobody to read its error: asyncio.shield drops its own reader on cancel."""
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    with ThreadPoolExecutor(1) as executor:
        waiter = asyncio.ensure_future(run_in_thread(executor, _fails_after, 0.2))
        await asyncio.sleep(0.05)
        waiter.cancel()
        await asyncio.wait([waiter])
        assert waiter.cancelled()
        del waiter
    await _collect_garbage()
    assert _messages(unretrieved) == []


async def test_a_join_whose_caller_was_cancelled_leaves_its_error_retrieved():
    """OpenChannel cancelled (its sender died) while the join's store connect still tried, and then failed."""
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    threads = TransferThreads.start(1)
    table = ChannelTable("B", "127.0.0.1", 10, threads.rendezvous)
    try:
        join = asyncio.ensure_future(table.accept("A", TransferBackend.GLOO, f"127.0.0.1:{free_port()}", 1, 1,
                                                  timeout_s=1.0))  # nothing listens there
        await asyncio.sleep(0.2)
        join.cancel()
        await asyncio.wait([join])
        del join
        while table.num_opens_under_way:  # the store connect gives up at its timeout
            await asyncio.sleep(0.1)
    finally:
        table.close()
        threads.shutdown()
    await _collect_garbage()
    assert _messages(unretrieved) == []


class PeerThatAnswersLate:
    """ExpectBlocks fails once `answer` is set (the peer says why only after our sends broke)."""

    piece_bytes = 1 << 20

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        await self.answer.wait()
        raise Unavailable("the transfer service at b:1 did not answer: deadline exceeded")


async def test_a_transfer_cancelled_while_it_waits_for_its_peers_answer_leaves_it_retrieved():
    """The sends broke (a FerryError), so the sender waits up to PEER_ANSWER_GRACE_S for the peer to say
    why; the transfer's RPC is cancelled meanwhile (its deadline), and then the peer answers. Seen in a
    two-service soak: 'Task exception was never retrieved' for BlockSender._expect."""
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    channel = ChannelWhoseSendsBlock(lambda: Unavailable("gloo send to b:1 failed"))
    peer = PeerThatAnswersLate()
    threads = TransferThreads.start(4)
    try:
        sender = BlockSender("A", (TransferBackend.GLOO,), FakeMappings(kvs, geometry),
                             StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), lambda address: peer,
                             threads, in_place_min_row_bytes=0)
        ids = tuple(range(12))
        transfer = asyncio.ensure_future(sender.transfer(
            BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False), 20))
        await asyncio.sleep(0.2)
        channel.release.set()  # the sends break ...
        await asyncio.sleep(0.2)  # ... and the sender waits for the peer's answer
        transfer.cancel()
        await asyncio.wait([transfer], timeout=10)
        assert transfer.cancelled()
        del transfer
        peer.answer.set()  # the peer's error comes after the transfer ended
        await asyncio.sleep(0.1)
    finally:
        channel.release.set()
        threads.shutdown()
    await _collect_garbage()
    assert _messages(unretrieved) == []


class ChannelWhoseReceivesFail(FakeChannel):
    """The first receive fails at once; the others fail once `release` is set (a broken channel's)."""

    def __init__(self) -> None:
        super().__init__(TransferBackend.GLOO)
        self.release, self.num_receives = threading.Event(), 0

    def recv(self, out, tag, timeout_s) -> None:
        with self.lock:
            self.num_receives += 1
            is_first = self.num_receives == 1
        if not is_first:
            self.release.wait(timeout_s)
        raise Unavailable("gloo receive from A failed: connection reset by peer")


async def test_a_receive_cancelled_while_it_waits_for_its_posted_receives_leaves_their_errors_retrieved():
    """A killed sender: the first posted receive fails, and the receiver's ExpectBlocks is cancelled (the
    sender's connection closed) while it waits for the other posted receives. Seen in a two-service soak:
    'Future exception was never retrieved' for each of them. They write into the staging slot, so the
    slot also stays taken until they have ended."""
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    channel = ChannelWhoseReceivesFail()
    threads = TransferThreads.start(4)
    staging = StagingPool(1, BLOCK_BYTES, 4)
    try:
        receiver = BlockReceiver(FakeMappings(kvs, geometry), staging, FakeChannels(channel), threads)
        header = IncomingBlocks(InstanceId("dst"), tuple(range(12)), geometry, 1, 4, (), "A")  # whole 4-row blocks
        receive = asyncio.ensure_future(receiver.receive_on_channel(header, TransferBackend.GLOO, 0, 20))
        while channel.num_receives < 3:  # the window's receives are posted, the first has failed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        receive.cancel()
        await asyncio.sleep(0.1)
        assert not receive.done()  # the posted receives still write into the slot's buffers
        channel.release.set()
        await asyncio.wait([receive], timeout=10)
        assert receive.cancelled()
        del receive
    finally:
        channel.release.set()
        threads.shutdown()
    await _collect_garbage()
    assert _messages(unretrieved) == []
