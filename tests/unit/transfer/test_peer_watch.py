"""PeerWatch: the channels and clients to a peer transfer service close as soon as etcd shows its life ended
(its record left, or another process took its id), not after idling 10 minutes."""

from __future__ import annotations

import asyncio
from types import MappingProxyType

import pytest

from services.common.membership import MembershipChange
from services.transfer.peer_watch import PeerWatch

pytestmark = pytest.mark.timeout(10)

GRACE_S = 0.2


class Closer:
    """Records what it was asked to close (ChannelTable's and TransferClients' methods alike)."""

    def __init__(self) -> None:
        self.closed: list[tuple[str, str]] = []
        self.lives: list[int] = []  # the incarnation each channel close named

    def close_outgoing(self, peer_address: str, incarnation: int = 0) -> int:
        self.closed.append(("outgoing", peer_address))
        self.lives.append(incarnation)
        return 1

    def close_incoming(self, peer_id: str, incarnation: int = 0) -> int:
        self.closed.append(("incoming", peer_id))
        self.lives.append(incarnation)
        return 1

    def close_peer(self, address: str) -> int:
        self.closed.append(("client", address))
        return 1


def _record(address: str, pid: int, instance_ids: tuple[str, ...] = (), incarnation: int | None = None) -> dict:
    record = {"transfer_id": "?", "address": address, "backends": ["grpc", "gloo"], "instance_ids": list(instance_ids),
              "pid": pid, "host": "h"}
    return record if incarnation is None else {**record, "incarnation": incarnation}


def _change(members: dict) -> MembershipChange:
    return MembershipChange(MappingProxyType(members), frozenset(), frozenset(), frozenset())


def _watch(members: dict) -> tuple[PeerWatch, Closer]:
    closer = Closer()
    return PeerWatch("self", closer, closer, members, GRACE_S), closer


async def test_a_peer_that_left_loses_its_outgoing_channels_and_client_at_once_and_its_incoming_after_the_grace():
    watch, closer = _watch({"A": _record("h:1", 10), "B": _record("h:2", 20)})
    watch.on_change(_change({"B": _record("h:2", 20)}))
    assert closer.closed == [("outgoing", "h:1"), ("client", "h:1")] and watch.num_away == 1
    await asyncio.sleep(2 * GRACE_S)
    assert closer.closed[2:] == [("incoming", "A")] and watch.num_away == 0


async def test_a_peer_back_in_the_same_life_keeps_its_incoming_channels():
    """A peer alive but stalled past its lease TTL registers again as it was: its next transfer here comes on
    the channel it has, which must still be open (closing it failed a transfer in tests/integration)."""
    watch, closer = _watch({"A": _record("h:1", 10)})
    watch.on_change(_change({}))
    watch.on_change(_change({"A": _record("h:1", 10)}))
    await asyncio.sleep(2 * GRACE_S)
    assert closer.closed == [("outgoing", "h:1"), ("client", "h:1")] and watch.num_away == 0


async def test_another_life_under_the_id_of_one_that_left_ends_its_incoming_channels_at_once():
    watch, closer = _watch({"A": _record("h:1", 10)})
    watch.on_change(_change({}))
    watch.on_change(_change({"A": _record("h:3", 11)}))
    assert closer.closed == [("outgoing", "h:1"), ("client", "h:1"), ("incoming", "A")] and watch.num_away == 0
    await asyncio.sleep(2 * GRACE_S)
    assert len(closer.closed) == 3


@pytest.mark.parametrize("new", [_record("h:3", 11), _record("h:1", 11)], ids=["new_port", "same_port"])
async def test_a_peer_restarted_under_its_id_has_its_old_lifes_channels_closed_at_once(new):
    watch, closer = _watch({"A": _record("h:1", 10)})
    watch.on_change(_change({"A": new}))
    assert closer.closed == [("outgoing", "h:1"), ("client", "h:1"), ("incoming", "A")]
    watch.on_change(_change({"A": {**new, "instance_ids": ["i-1"]}}))  # the new life maps an instance
    assert len(closer.closed) == 3


async def test_mapping_changes_new_peers_and_its_own_record_close_nothing():
    watch, closer = _watch({"A": _record("h:1", 10), "self": _record("h:9", 1)})
    watch.on_change(_change({"A": _record("h:1", 10, ("i-1",)), "self": _record("h:9", 1), "C": _record("h:5", 5)}))
    watch.on_change(_change({"A": _record("h:1", 10, ("i-1",)), "C": _record("h:5", 5)}))  # its own lease lapsed
    assert closer.closed == []


async def test_changes_seen_together_close_every_ended_life_once():
    """A resync after etcd was unreachable shows several changes at once: a peer gone, another restarted."""
    watch, closer = _watch({"A": _record("h:1", 10), "B": _record("h:2", 20)})
    watch.on_change(_change({"B": _record("h:7", 21), "D": _record("h:8", 40)}))
    watch.on_change(_change({"B": _record("h:7", 21), "D": _record("h:8", 40)}))
    await asyncio.sleep(2 * GRACE_S)
    assert sorted(closer.closed) == [("client", "h:1"), ("client", "h:2"), ("incoming", "A"), ("incoming", "B"),
                                     ("outgoing", "h:1"), ("outgoing", "h:2")]


async def test_the_closes_name_the_life_that_ended():
    """The channels a newer life under the id opened stay (ChannelTable keeps those another life joined): a peer
    restarted on its own port opens channels before its record says it restarted."""
    watch, closer = _watch({"A": _record("h:1", 10, incarnation=7), "B": _record("h:2", 20, incarnation=8)})
    watch.on_change(_change({"A": _record("h:1", 11, incarnation=9)}))  # A restarted on its port, B left
    assert closer.closed == [("outgoing", "h:1"), ("client", "h:1"), ("incoming", "A"), ("outgoing", "h:2"),
                             ("client", "h:2")]
    assert closer.lives == [7, 7, 8]
    await asyncio.sleep(2 * GRACE_S)
    assert closer.closed[5:] == [("incoming", "B")] and closer.lives[3:] == [8]
