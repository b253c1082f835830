"""A refused channel transfer: the receiver takes the rest of its messages and both ends keep the channel
(receiver.py `_discard_rest`, sender.py `_expect`), and a sender whose send broke reports the receiver's reason."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.common.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads
from services.transfer.write_grants import WriteGrants
from tests.unit.transfer.factories import random_kv, rows_of, tiny_geometry
from tests.unit.transfer.test_channel_window import BLOCK_BYTES, DirectPeer, FakeChannel

pytestmark = pytest.mark.timeout(60)


class RecordingChannels:
    def __init__(self, channel) -> None:
        self.channel = channel
        self.dropped: list[str] = []

    async def outgoing(self, peer_address, backend, open_remote, timeout_s=None):
        return self.channel

    def incoming(self, peer_id, backend, channel_id=0):
        return self.channel

    def drop_outgoing(self, peer_address, backend, only=None) -> None:
        self.dropped.append("outgoing")

    def drop_incoming(self, peer_id, backend, only=None) -> None:
        self.dropped.append("incoming")


class Mappings:
    def __init__(self, kvs, geometries) -> None:
        self.kvs, self.geometries = kvs, geometries
        self.write_grants = WriteGrants()

    def rows(self, instance_id):
        return rows_of(self.kvs[instance_id]), self.geometries[instance_id]


class HookedChannel(FakeChannel):
    """gloo's matching rule; `on_recv(n)` runs before the n-th receive; `corrupt` flips a received chunk."""

    def __init__(self, backend=TransferBackend.GLOO) -> None:
        super().__init__(backend)
        self.num_recvs = 0
        self.on_recv = None
        self.corrupt_recv: int | None = None

    def recv(self, out, tag, timeout_s):
        with self.lock:
            self.num_recvs += 1
            n = self.num_recvs
        if self.on_recv is not None:
            self.on_recv(n)
        super().recv(out, tag, timeout_s)
        if n == self.corrupt_recv:
            out.view(torch.uint8).view(-1)[0] ^= 0xFF

    def leftover(self) -> int:
        return sum(q.qsize() for q in self.slots.values())


def _setup(channel, dst_geometry=None, buffers=4):
    geometry = tiny_geometry(num_blocks=24)
    dst_geometry = dst_geometry or geometry
    kvs = {"src": random_kv(geometry, 1), "dst": torch.zeros(dst_geometry.shape, dtype=dst_geometry.dtype)}
    mappings = Mappings(kvs, {"src": geometry, "dst": dst_geometry})
    threads = TransferThreads.start(buffers)
    channels = RecordingChannels(channel)
    receiver = BlockReceiver(mappings, StagingPool(1, BLOCK_BYTES, buffers), channels, threads)
    peer = DirectPeer(receiver)
    sender = BlockSender("a", (channel.backend,), mappings, StagingPool(1, BLOCK_BYTES, buffers), channels,
                         lambda address: peer, threads, in_place_min_row_bytes=256)
    return kvs, mappings, channels, threads, sender


# Spans (in place on both sides), staged blocks, a span in place on one side only.
SRC_IDS = (3, 4, 5, 6, 7, 8, 20, 1, 10, 11, 12, 14, 15, 16)
DST_IDS = (10, 11, 12, 13, 14, 15, 2, 0, 5, 6, 7, 23, 17, 9)


async def _then_a_healthy_transfer_lands(sender, kvs, backend, grant=0):
    kvs["dst"].zero_()
    src_ids, dst_ids = (0, 1, 2, 21, 22), (1, 2, 3, 18, 19)
    await asyncio.wait_for(sender.transfer(BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids,
                                                         "b:1", backend, True, grant), timeout_s=5), 10)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kvs["dst"][:, :, d], kvs["src"][:, :, s])


@pytest.mark.parametrize("refusal", ["closed_grant", "revoked_mid_stream", "checksum", "geometry"])
@pytest.mark.parametrize("backend", [TransferBackend.GLOO, TransferBackend.NCCL])
async def test_a_refused_transfer_is_drained_exactly_and_the_channel_kept(refusal, backend):
    channel = HookedChannel(backend)
    dst_geometry = tiny_geometry(num_blocks=24, dtype=torch.bfloat16) if refusal == "geometry" else None
    kvs, mappings, channels, threads, sender = _setup(channel, dst_geometry)
    grant = 0
    if refusal in ("closed_grant", "revoked_mid_stream"):
        mappings.write_grants.grant(InstanceId("dst"), 7)
        grant = 7 if refusal == "revoked_mid_stream" else 8
    if refusal == "revoked_mid_stream":
        def revoke(n):
            if n == 9:
                mappings.write_grants.revoke_all(InstanceId("dst"))
        channel.on_recv = revoke
    if refusal == "checksum":
        channel.corrupt_recv = 3
    expected = {"closed_grant": FailedPrecondition, "revoked_mid_stream": Aborted, "checksum": Aborted,
                "geometry": InvalidArgument}[refusal]
    try:
        with pytest.raises(expected):
            await asyncio.wait_for(sender.transfer(BlockTransfer(
                InstanceId("src"), SRC_IDS, InstanceId("dst"), DST_IDS, "b:1", backend, True, grant), timeout_s=5), 10)
        assert channels.dropped == []
        assert channel.leftover() == 0
        channel.on_recv = None
        channel.corrupt_recv = None
        if refusal != "geometry":
            healthy_grant = 0
            if refusal in ("closed_grant", "revoked_mid_stream"):
                mappings.write_grants.grant(InstanceId("dst"), 9)
                healthy_grant = 9
            await _then_a_healthy_transfer_lands(sender, kvs, backend, healthy_grant)
            assert channels.dropped == [] and channel.leftover() == 0
    finally:
        threads.shutdown()


class BrokenChannel(FakeChannel):
    """The receiver dropped its end: every send breaks."""

    def send(self, data, tag, timeout_s):
        raise Unavailable("gloo send to peer failed: Connection closed by peer")


class RefusingPeer:
    """Answers a clean refusal a moment after our send broke (it dropped its channel, then answered)."""

    piece_bytes = 1 << 20

    async def expect_blocks(self, header, backend, tag, timeout_s, channel_id=0):
        await asyncio.sleep(0.2)
        raise Aborted("write grant 7 of instance 'dst' was revoked while blocks were arriving")


async def test_the_sender_reports_the_receivers_refusal_when_its_send_broke_first():
    """The receiver dropped its end (so our send broke), then answered why: the sender reports that
    reason at once. (Found by a review: the sender once held the answer back and reported its own break.)"""
    channel = BrokenChannel(TransferBackend.GLOO)
    geometry = tiny_geometry(num_blocks=24)
    kvs = {"src": random_kv(geometry, 1)}
    mappings = Mappings(kvs, {"src": geometry})
    threads = TransferThreads.start(4)
    try:
        sender = BlockSender("a", (TransferBackend.GLOO,), mappings, StagingPool(1, BLOCK_BYTES, 4),
                             RecordingChannels(channel), lambda address: RefusingPeer(), threads)
        started = time.monotonic()
        with pytest.raises(Aborted):
            await asyncio.wait_for(sender.transfer(BlockTransfer(
                InstanceId("src"), (1, 2, 3), InstanceId("dst"), (4, 5, 6), "b:1", TransferBackend.GLOO, False, 7),
                timeout_s=5), 10)
        assert time.monotonic() - started < 0.9
    finally:
        threads.shutdown()
