"""A channel knows which life of its peer joined it (real gloo groups, in one process): the end of a peer's older
life closes that life's channels only, never those its newer life opened before the news of the old one's end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.transfer.channels import ChannelTable
from services.transfer.domain import TransferBackend

pytestmark = pytest.mark.timeout(60)
GLOO = TransferBackend.GLOO
OLD_LIFE, NEW_LIFE, B_LIFE = 11, 12, 20


async def _open(sender: ChannelTable, sender_id: str, receiver: ChannelTable, address: str):
    async def open_remote(store_address: str, rank: int, num_connections: int, channel_id: int) -> int:
        await receiver.accept(sender_id, GLOO, store_address, rank, num_connections, channel_id=channel_id,
                              peer_incarnation=sender.incarnation)
        return receiver.incarnation
    return await sender.outgoing(address, GLOO, open_remote)


async def test_the_end_of_a_peers_old_life_keeps_the_channels_its_new_life_joined():
    """Before, a peer restarted on its own port (it answers before it registers) opened channels with B that B's
    close of its old life then took too: the new life's next transfer to B failed UNAVAILABLE, and B's next one
    to it opened one more."""
    with ThreadPoolExecutor(8) as pool:
        b = ChannelTable("B", "127.0.0.1", 10, pool, incarnation=B_LIFE)
        old_a = ChannelTable("A", "127.0.0.1", 10, pool, incarnation=OLD_LIFE)
        new_a = ChannelTable("A", "127.0.0.1", 10, pool, incarnation=NEW_LIFE)  # restarted under its id and port
        try:
            await _open(old_a, "A", b, "b:1")
            old_a.close()  # killed
            from_new = await _open(new_a, "A", b, "b:1")  # replaces the old life's channel at B
            to_new = await _open(b, "B", new_a, "a:1")
            assert from_new.peer_incarnation == B_LIFE and to_new.peer_incarnation == NEW_LIFE
            # etcd now tells B that the old life of A ended
            assert b.close_outgoing("a:1", incarnation=OLD_LIFE) == 0
            assert b.close_incoming("A", incarnation=OLD_LIFE) == 0
            assert b.incoming("A", GLOO).channel_id == from_new.channel_id
            assert await _open(b, "B", new_a, "a:1") is to_new
            # ... and when the new life ends, or a life is not known (a record from before the field), they go
            assert b.close_incoming("A", incarnation=NEW_LIFE) == 1 and b.close_outgoing("a:1") == 1
            assert b.num_channels == 0
            await b.wait_closed()
        finally:
            for table in (b, old_a, new_a):
                table.close()


async def test_a_channel_from_a_peer_that_names_no_life_closes_with_any_of_its_lives():
    """A peer from before the field names none (0): any life's end may be its own."""
    with ThreadPoolExecutor(8) as pool:
        b = ChannelTable("B", "127.0.0.1", 10, pool, incarnation=B_LIFE)
        a = ChannelTable("A", "127.0.0.1", 10, pool)  # incarnation 0: unknown
        try:
            await _open(a, "A", b, "b:1")
            assert b.close_incoming("A", incarnation=OLD_LIFE) == 1
            await b.wait_closed()
        finally:
            b.close()
            a.close()
