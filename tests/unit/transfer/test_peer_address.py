"""One peer transfer service, however its address is spelled (localhost or 127.0.0.1, [::1] or ::1, a
zero-padded port), has one outgoing channel, and etcd's record of it closes that channel and every
client of it. Two spellings opened two channels, while the peer keeps one incoming channel per sender,
so each open replaced the other's at the peer; and a record's address matched only its own spelling."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.transfer.channels import ChannelTable
from services.transfer.client import TransferClients
from tests.unit.transfer.test_idle_channels import _open

pytestmark = pytest.mark.timeout(60)


async def test_spellings_of_one_address_share_its_channel_and_its_record_closes_it():
    with ThreadPoolExecutor(8) as pool:
        receiver = ChannelTable("B", "127.0.0.1", 10, pool)
        sender = ChannelTable("A", "127.0.0.1", 10, pool)
        try:
            channel = await _open(sender, "A", receiver, "localhost:7001")
            assert await _open(sender, "A", receiver, "127.0.0.1:7001") is channel
            assert await _open(sender, "A", receiver, "LocalHost.:07001") is channel
            assert sender.num_channels == 1
            assert sender.close_outgoing("127.0.0.1:7001") == 1  # PeerWatch, with the record's spelling
            assert sender.num_channels == 0
            ipv6 = await _open(sender, "A", receiver, "[::1]:7002")
            assert await _open(sender, "A", receiver, "[0:0::1]:7002") is ipv6
            assert sender.close_outgoing("::1:7002") == 1  # how a service bound to ::1 writes its address
        finally:
            receiver.close()
            sender.close()


async def test_the_record_of_a_peer_that_left_closes_its_client_under_every_spelling():
    """Each spelling keeps a client of its own (it dials the address as given: a TLS certificate may
    name only that one); the record's address closes them all."""
    clients = TransferClients()
    clients("localhost:7001"), clients("127.0.0.1:7001"), clients("127.0.0.1:7002")
    assert clients.close_peer("127.0.0.1:7001") == 2
    assert clients.addresses == ["127.0.0.1:7002"]
    await clients.close()
