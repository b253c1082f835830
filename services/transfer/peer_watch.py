"""PeerWatch: close the channels and clients to a peer transfer service as soon as etcd says its life ended.

The tables close what no transfer took for `idle_close_s` (10 minutes) when a new peer comes along.
A peer that restarts (a new process, new ports, often a new id) would leave its old life's gloo
groups (threads, sockets, a store) and gRPC client here until then: during a rolling restart of a
fleet, that is growth without bound for 10 minutes. So this service watches `transfer/` in etcd.

A life is what a peer's record says of its process: address, host and pid. It ended when its record
left (the lease was revoked at shutdown or expired after a kill) or another life took its id (it
restarted under the same `--transfer-id`, on its port or another). A change of the instances a peer
maps is the same life. Then every outgoing channel and client to its address and every incoming
channel from its id leave the tables at once; each is closed now, or once the transfers on it end
(one on a dead peer fails by its deadline; one on a peer that was only briefly away completes). The
next transfer opens afresh. A peer that lost its lease while alive (stalled past `--lease-ttl-s`)
counts as gone too: its channels are reopened, once, on the next transfer each way.

Runs on the event loop, in the membership view's callback: taking entries out is synchronous, and
closing an idle channel or client is bounded (gRPC clients close as tasks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from services.common.membership import MembershipChange
from services.transfer.domain import TransferId
from services.transfer.metrics import PEER_CLOSES

log = structlog.get_logger(__name__)


class ChannelCloser(Protocol):
    def close_peer(self, peer_address: str, peer_id: str) -> int:
        """Close the channels to a gone peer; how many."""


class ClientCloser(Protocol):
    def close_peer(self, address: str) -> int:
        """Close the client of a gone peer; how many (0 or 1)."""


@dataclass(frozen=True, slots=True)
class PeerLife:
    """One process's registration as a transfer service (its `transfer/<id>` record)."""

    transfer_id: TransferId
    address: str
    host: str
    pid: int

    @classmethod
    def from_record(cls, transfer_id: str, record: Mapping[str, Any]) -> PeerLife:
        return cls(TransferId(transfer_id), str(record.get("address", "")), str(record.get("host", "")),
                   int(record.get("pid", 0)))


def lives_of(members: Mapping[str, Mapping[str, Any]], own_id: str) -> dict[str, PeerLife]:
    """Every peer's current life, this service's own record left out."""
    return {member_id: PeerLife.from_record(member_id, record) for member_id, record in members.items()
            if member_id != own_id}


class PeerWatch:
    def __init__(self, own_id: str, channels: ChannelCloser, clients: ClientCloser,
                 members: Mapping[str, Mapping[str, Any]]) -> None:
        """`members`: the transfer records now (the lives this service may already hold channels to)."""
        self._own_id = own_id
        self._channels = channels
        self._clients = clients
        self._lives = lives_of(members, own_id)

    def on_change(self, change: MembershipChange) -> None:
        """MembershipView's callback: close what the ended lives left (it sees every change, and compares
        whole views, so changes it sees together are handled as well)."""
        lives = lives_of(change.members, self._own_id)
        for member_id, life in self._lives.items():
            now = lives.get(member_id)
            if now != life:
                self.close_life(life, "left" if now is None else "restarted")
        self._lives = lives

    def close_life(self, life: PeerLife, why: str) -> None:
        num_channels = self._channels.close_peer(life.address, life.transfer_id)
        num_clients = self._clients.close_peer(life.address)
        PEER_CLOSES.labels("channel").inc(num_channels)
        PEER_CLOSES.labels("client").inc(num_clients)
        log.info("peer_gone", peer_transfer_id=life.transfer_id, peer=life.address, pid=life.pid, why=why,
                 num_channels_closed=num_channels, num_clients_closed=num_clients)
