"""Pair channels (real gloo groups, in one process) from peers that went away are dropped once idle."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.transfer.channels import ChannelTable
from services.transfer.domain import TransferBackend

pytestmark = pytest.mark.timeout(60)
IDLE_S = 0.5


async def _open(sender: ChannelTable, sender_id: str, receiver: ChannelTable, address: str = "b:1"):
    async def open_remote(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
        await receiver.accept(sender_id, TransferBackend.GLOO, store_address, rank, num_connections,
                              channel_id=channel_id)
    return await sender.outgoing(address, TransferBackend.GLOO, open_remote)


async def test_channels_of_a_peer_that_restarted_under_a_new_id_are_dropped_once_idle():
    """Before, every incarnation of a restarted peer left a gloo group (threads, sockets, a store) behind."""
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=IDLE_S)
        senders = [ChannelTable(f"A-{n}", "127.0.0.1", 10, pool, idle_close_s=IDLE_S) for n in range(3)]
        try:
            await _open(senders[0], "A-0", receiver)
            await _open(senders[1], "A-1", receiver)
            assert receiver.num_channels == 2
            await asyncio.sleep(2 * IDLE_S)  # are gone: their channels go when the next one opens
            receiver.incoming("A-1", TransferBackend.GLOO)  # ... unless a transfer took one meanwhile
            await _open(senders[2], "A-2", receiver)
            assert receiver.num_channels == 2  # A-1 (used just now) and A-2
            with pytest.raises(Exception, match="no gloo channel from transfer service 'A-0'"):
                receiver.incoming("A-0", TransferBackend.GLOO)
        finally:
            for table in (receiver, *senders):
                table.close()


async def test_an_outgoing_channel_idle_for_long_is_opened_afresh():
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=60)
        sender = ChannelTable("A", "127.0.0.1", 10, pool, idle_close_s=IDLE_S)
        try:
            first = await _open(sender, "A", receiver, "b:1")
            assert await _open(sender, "A", receiver, "b:1") is first  # in use: kept
            await asyncio.sleep(IDLE_S)
            await _open(sender, "A", receiver, "c:1")  # another peer: idle ones are dropped now
            assert first.group is None and sender.num_channels == 1
            again = await _open(sender, "A", receiver, "b:1")
            assert again is not first and again.group is not None
        finally:
            receiver.close()
            sender.close()


async def test_a_sender_back_after_a_long_pause_opens_afresh_the_channel_its_peer_dropped():
    """Before, it reused its old channel, which the receiver had dropped meanwhile (another peer's open
    dropped it): that transfer failed with "no gloo channel from transfer service 'A'"."""
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=IDLE_S)
        sender = ChannelTable("A", "127.0.0.1", 10, pool, idle_close_s=IDLE_S)
        other = ChannelTable("C", "127.0.0.1", 10, pool, idle_close_s=IDLE_S)
        try:
            first = await _open(sender, "A", receiver)
            await asyncio.sleep(2 * IDLE_S)
            await _open(other, "C", receiver)  # B drops A's end, idle for twice the limit
            again = await _open(sender, "A", receiver)
            assert again is not first and receiver.incoming("A", TransferBackend.GLOO).group is not None
        finally:
            for table in (receiver, sender, other):
                table.close()


async def test_peers_that_could_not_be_reached_leave_no_lock_behind():
    """Before, every (address, backend) ever dialled kept its asyncio.Lock for good, also when its open
    failed (a peer that went away, restarted on a new port) or its channel was dropped after a failed
    transfer: the table grew by one lock per peer incarnation for as long as the service ran."""
    async def refuse(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
        raise ConnectionError("peer gone")
    with ThreadPoolExecutor(8) as pool:
        sender = ChannelTable("A", "127.0.0.1", 1, pool, idle_close_s=IDLE_S)
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=60)
        try:
            for port in range(3):
                with pytest.raises(ConnectionError):
                    await sender.outgoing(f"gone:{port}", TransferBackend.GLOO, refuse)
            assert sender.num_locks == 0 and sender.num_channels == 0
            await _open(sender, "A", receiver, "b:1")
            sender.drop_outgoing("b:1", TransferBackend.GLOO)  # as after a failed transfer
            assert sender.num_locks == 0 and sender.num_channels == 0
        finally:
            receiver.close()
            sender.close()


async def test_a_gone_peers_channels_close_at_once_and_one_in_use_when_its_transfer_ends():
    """A peer gone from etcd (left, or restarted) has its channels closed (PeerWatch), not after idle_close_s:
    outgoing ones by its address, incoming ones by its id; one a transfer uses now stays open until it ends."""
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=60)
        sender = ChannelTable("A", "127.0.0.1", 10, pool, idle_close_s=60)
        try:
            outgoing = await _open(sender, "A", receiver, "b:1")
            incoming = receiver.incoming("A", TransferBackend.GLOO)
            assert sender.close_outgoing("c:1") == 0 and receiver.close_incoming("C") == 0  # other peers
            assert sender.close_incoming("B") == 0 and receiver.close_outgoing("a:1") == 0  # the other direction
            with incoming.in_use():
                assert receiver.close_incoming("A") == 1
                await receiver.wait_closed()
                assert incoming.group is not None and receiver.num_channels == 0  # a transfer still uses it
                with pytest.raises(Exception, match="no gloo channel from transfer service 'A'"):
                    receiver.incoming("A", TransferBackend.GLOO)  # no new transfer takes it
            await receiver.wait_closed()
            assert incoming.group is None
            assert sender.close_outgoing("b:1") == 1
            await sender.wait_closed()
            assert outgoing.group is None and sender.num_channels == 0
            again = await _open(sender, "A", receiver, "b:1")  # the next transfer opens afresh
            assert again is not outgoing and again.group is not None
        finally:
            receiver.close()
            sender.close()


async def test_a_failed_transfer_on_a_retired_channel_closes_it_and_not_the_fresh_one():
    """Once its peer is gone a channel leaves the table while its transfer runs, and the next transfer may open
    a fresh one under the same address: the failing transfer's drop closes its own channel, never the fresh one."""
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool, idle_close_s=60)
        sender = ChannelTable("A", "127.0.0.1", 10, pool, idle_close_s=60)
        try:
            old = await _open(sender, "A", receiver, "b:1")
            with old.in_use():
                sender.close_outgoing("b:1")
                fresh = await _open(sender, "A", receiver, "b:1")
                sender.drop_outgoing("b:1", TransferBackend.GLOO, only=old)  # the old transfer failed
                assert old.group is None and fresh.group is not None and sender.num_channels == 1
            await sender.wait_closed()
        finally:
            receiver.close()
            sender.close()
