"""The channel id goes over the wire both ways: the client puts it in OpenChannel and ExpectBlocks, and
the servicer hands it to the channel table and the receiver (0 when an older sender leaves it out). So do both
ends' incarnations (OpenChannel's `peer_incarnation`, its response's `incarnation`). No sockets: the stub and the
node are stand-ins."""

from __future__ import annotations

import types

import pytest

from services.common.gen.ferry.v1 import transfer_pb2
from services.transfer.client import TransferClient
from services.transfer.convert import header_to_proto
from services.transfer.domain import IncomingBlocks, InstanceId, TransferBackend, TransferId
from services.transfer.server import TransferServicer
from tests.unit.transfer.factories import tiny_geometry

pytestmark = pytest.mark.timeout(10)

HEADER = IncomingBlocks(InstanceId("dst"), (1, 2), tiny_geometry(), 1, 4, (), TransferId("A"))


class Calls:
    """Stands in for the stub, the channel table and the receiver: records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            self.calls.append((name, args))
            if name == "OpenChannel":
                return transfer_pb2.OpenChannelResponse(incarnation=9)
            return transfer_pb2.ExpectBlocksResponse(num_bytes=1) if name == "ExpectBlocks" else 1
        return call


async def test_the_client_sends_the_channel_id():
    client = TransferClient("127.0.0.1:1")
    client._stub = stub = Calls()
    assert await client.open_channel("A", "127.0.0.1:2", 1, TransferBackend.GLOO, 4, 5, 42, incarnation=7) == 9
    await client.expect_blocks(HEADER, TransferBackend.GLOO, 64, 5, 42)
    assert [args[0].channel_id for _name, args in stub.calls] == [42, 42]
    assert stub.calls[0][1][0].peer_incarnation == 7
    await client.close()


@pytest.mark.parametrize("channel_id", [42, 0])
async def test_the_servicer_hands_the_channel_id_on(channel_id):
    node = Calls()
    node.channels, node.receiver, node.max_timeout_s = Calls(), Calls(), 5.0
    node.channels.incarnation = 9
    servicer = TransferServicer()
    servicer.node = node
    context = types.SimpleNamespace(time_remaining=lambda: None)
    opened = await servicer.OpenChannel(transfer_pb2.OpenChannelRequest(
        peer_transfer_id="A", store_address="127.0.0.1:2", rank=1, backend=transfer_pb2.TRANSFER_BACKEND_GLOO,
        channel_id=channel_id, peer_incarnation=channel_id // 6), context)
    assert opened.incarnation == 9
    assert node.channels.calls[0][1][-2:] == (channel_id, channel_id // 6)  # the sender's life: 0 from an older one
    await servicer.ExpectBlocks(transfer_pb2.ExpectBlocksRequest(
        header=header_to_proto(HEADER), backend=transfer_pb2.TRANSFER_BACKEND_GLOO, tag=64, channel_id=channel_id),
        context)
    assert [(name, args[-1]) for name, args in node.receiver.calls] == [("receive_on_channel", channel_id)]
