"""PeerWatch: the channels and clients to a peer transfer service close as soon as etcd shows its life ended
(its record left, or another process took its id), not after idling 10 minutes."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from services.common.membership import MembershipChange
from services.transfer.peer_watch import PeerWatch

pytestmark = pytest.mark.timeout(10)


class Closer:
    """Records what it was asked to close (ChannelTable and TransferClients alike)."""

    def __init__(self) -> None:
        self.closed: list[tuple[str, ...]] = []

    def close_peer(self, *peer: str) -> int:
        self.closed.append(peer)
        return 1


def _record(address: str, pid: int, instance_ids: tuple[str, ...] = ()) -> dict:
    return {"transfer_id": "?", "address": address, "backends": ["grpc", "gloo"], "instance_ids": list(instance_ids),
            "pid": pid, "host": "h"}


def _change(members: dict) -> MembershipChange:
    return MembershipChange(MappingProxyType(members), frozenset(), frozenset(), frozenset())


def _watch(members: dict) -> tuple[PeerWatch, Closer, Closer]:
    channels, clients = Closer(), Closer()
    return PeerWatch("self", channels, clients, members), channels, clients


def test_a_peer_that_left_has_its_channels_and_client_closed():
    watch, channels, clients = _watch({"A": _record("h:1", 10), "B": _record("h:2", 20)})
    watch.on_change(_change({"B": _record("h:2", 20)}))
    assert channels.closed == [("h:1", "A")] and clients.closed == [("h:1",)]


@pytest.mark.parametrize("new", [_record("h:3", 11), _record("h:1", 11)], ids=["new_port", "same_port"])
def test_a_peer_restarted_under_its_id_has_its_old_lifes_channels_closed(new):
    watch, channels, clients = _watch({"A": _record("h:1", 10)})
    watch.on_change(_change({"A": new}))
    assert channels.closed == [("h:1", "A")] and clients.closed == [("h:1",)]
    watch.on_change(_change({"A": {**new, "instance_ids": ["i-1"]}}))  # the new life maps an instance
    assert len(channels.closed) == 1


def test_mapping_changes_new_peers_and_its_own_record_close_nothing():
    watch, channels, clients = _watch({"A": _record("h:1", 10), "self": _record("h:9", 1)})
    watch.on_change(_change({"A": _record("h:1", 10, ("i-1",)), "self": _record("h:9", 1), "C": _record("h:5", 5)}))
    watch.on_change(_change({"A": _record("h:1", 10, ("i-1",)), "C": _record("h:5", 5)}))  # its own lease lapsed
    assert channels.closed == [] and clients.closed == []


def test_changes_seen_together_close_every_ended_life_once():
    """A resync after etcd was unreachable shows several changes at once: a peer gone, another restarted."""
    watch, channels, _clients = _watch({"A": _record("h:1", 10), "B": _record("h:2", 20)})
    watch.on_change(_change({"B": _record("h:7", 21), "D": _record("h:8", 40)}))
    watch.on_change(_change({"B": _record("h:7", 21), "D": _record("h:8", 40)}))
    assert sorted(channels.closed) == [("h:1", "A"), ("h:2", "B")]
