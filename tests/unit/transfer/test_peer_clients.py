"""TransferClients, the sender's cached client per peer transfer service: a peer that restarts comes
back under a new address (the default port is 0), and each old address kept its gRPC channel for
good (found by a code review). Now a client neither taken nor called for `idle_close_s` is closed
when a new address is taken, never one with a call under way. No sockets: nothing is dialled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from services.common.idle_table import IdleClosingTable, Usage
from services.transfer.client import TransferClient, TransferClients
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads
from tests.unit.transfer.factories import random_kv, tiny_geometry
from tests.unit.transfer.test_channel_window import BLOCK_BYTES, DirectPeer, FakeChannel, FakeChannels, FakeMappings

pytestmark = pytest.mark.timeout(10)

IDLE_S = 600.0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def closed(monkeypatch) -> list[str]:
    """The addresses whose clients were closed, in order."""
    addresses: list[str] = []
    real_close = TransferClient.close

    async def close(client: TransferClient) -> None:
        addresses.append(client.address)
        await real_close(client)
    monkeypatch.setattr(TransferClient, "close", close)
    return addresses


async def test_a_client_idle_that_long_is_closed_when_a_new_peer_is_taken(closed):
    clock = Clock()
    clients = TransferClients(idle_close_s=IDLE_S, clock=clock)
    first = clients("127.0.0.1:1001")
    assert clients("127.0.0.1:1001") is first  # cached
    clock.now += IDLE_S - 1
    clients("127.0.0.1:1001")  # taken again: its idle time starts over
    clock.now += IDLE_S - 1
    clients("127.0.0.1:1002")
    assert clients.addresses == ["127.0.0.1:1001", "127.0.0.1:1002"]
    clock.now += IDLE_S
    clients("127.0.0.1:1003")
    await asyncio.sleep(0.05)
    assert clients.addresses == ["127.0.0.1:1003"] and closed == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert clients("127.0.0.1:1001") is not first  # a peer back on an old address gets a fresh client
    await clients.close()


async def test_a_client_with_a_call_under_way_is_never_closed(closed):
    clock = Clock()
    clients = TransferClients(idle_close_s=IDLE_S, clock=clock)
    busy = clients("127.0.0.1:1001")
    answer = asyncio.Event()

    async def get_status(request, timeout, metadata):  # a call the peer takes long to answer
        await answer.wait()
        return "status"
    busy._stub.GetStatus = get_status
    call = asyncio.create_task(busy.get_status())
    await asyncio.sleep(0.01)
    clock.now += 10 * IDLE_S
    clients("127.0.0.1:1002")
    await asyncio.sleep(0.05)
    assert "127.0.0.1:1001" in clients.addresses and not closed
    answer.set()
    assert await call == "status"
    clock.now += IDLE_S - 1  # idle from when its call ended
    clients("127.0.0.1:1003")
    assert "127.0.0.1:1001" in clients.addresses
    clock.now += 1
    clients("127.0.0.1:1004")
    await asyncio.sleep(0.05)
    assert "127.0.0.1:1001" not in clients.addresses and "127.0.0.1:1001" in closed
    await clients.close()
    assert sorted(closed) == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003", "127.0.0.1:1004"]


class ClosablePeer(DirectPeer):
    """A peer client that counts its calls (as TransferClient does) and fails them once closed."""

    def __init__(self, receiver: BlockReceiver, usage: Usage) -> None:
        super().__init__(receiver)
        self.usage, self.is_closed = usage, False

    async def close(self) -> None:
        self.is_closed = True

    async def open_channel(self, peer_transfer_id, store_address, rank, backend, num_connections, timeout_s,
                           channel_id=0, incarnation=0):
        with self.usage.call():
            assert not self.is_closed

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        with self.usage.call():
            if self.is_closed:
                raise RuntimeError("Channel is closed")  # what grpc.aio raises (UsageError)
            return await super().expect_blocks(header, backend, tag, timeout_s, channel_id)


class OpeningChannels(FakeChannels):
    """Opens through `open_remote`; `after_open` runs once it answered."""

    def __init__(self, channel: FakeChannel, after_open: Callable[[], None]) -> None:
        super().__init__(channel)
        self.after_open = after_open

    async def outgoing(self, peer_address, backend, open_remote, timeout_s=None):
        await open_remote("127.0.0.1:1", 1, 1, 7)
        self.after_open()
        return self.channel


async def test_the_bound_closes_no_peer_client_a_transfer_still_needs():
    """Past the table's bound the least recently used client with no call under way closes. A channel
    transfer kept the client it had opened the channel with and called ExpectBlocks on it later: had
    other transfers taken more new peers than the bound meanwhile (4096 here), that call met a
    closed client. The sender now takes its client for each call."""
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(geometry.shape, dtype=geometry.dtype)}
    mappings, channel = FakeMappings(kvs, geometry), FakeChannel(TransferBackend.GLOO)
    threads = TransferThreads.start(4)
    try:
        receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, 4), FakeChannels(channel), threads)
        table: IdleClosingTable[ClosablePeer] = IdleClosingTable(ClosablePeer.close, "peer", max_entries=2)

        def peers(address: str) -> ClosablePeer:
            return table.take(address, lambda usage: ClosablePeer(receiver, usage)).value

        def other_transfers_meet_new_peers() -> None:
            peers("127.0.0.1:2001")
            peers("127.0.0.1:2002")
        sender = BlockSender("a", (TransferBackend.GLOO,), mappings, StagingPool(1, BLOCK_BYTES, 4),
                             OpeningChannels(channel, other_transfers_meet_new_peers), peers, threads)
        ids = tuple(range(12))
        await asyncio.wait_for(sender.transfer(
            BlockTransfer(InstanceId("src"), ids, InstanceId("dst"), ids, "b:1", TransferBackend.GLOO, False), 3), 5)
        assert torch.equal(kvs["dst"][:, :, list(ids)], kvs["src"][:, :, list(ids)])
        await table.close()
    finally:
        threads.shutdown()
