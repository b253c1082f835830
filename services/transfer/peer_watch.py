"""PeerWatch: close the channels and clients to a peer transfer service as soon as etcd says its life ended.

The tables close what no transfer took for `idle_close_s` (10 minutes) when a new peer comes along.
A peer that restarts (a new process, new ports, often a new id) would leave its old life's gloo
groups (threads, sockets, a store) and gRPC client here until then: during a rolling restart of a
fleet, that is growth without bound for 10 minutes. So this service watches `transfer/` in etcd.

A life is what a peer's record says of its process: address, host, pid and incarnation (random, chosen at its
start). A change of the instances it maps is the same life. The tables close only the channels that life joined
(`ChannelTable`): a peer restarted on its own port may open channels here before its new record arrives.

* Another life took its id (it restarted under the same `--transfer-id`, on its port or another):
  the old life is dead. Its outgoing channels and client (by its address) and its incoming channels
  (by its id) close at once.
* Its record left (the lease was revoked at shutdown, or expired: killed, or alive but stalled past
  its lease TTL, a lapse its registry mends by registering again): the outgoing channels and client
  close at once (this side just opens afresh if the peer is back). The incoming ones close once the
  same life has stayed away for `incoming_grace_s`, or at once when another life takes its id: a
  stalled peer's next transfer here comes on its old channel, which must still be open.

"Close" takes the entry out of its table at once; it closes now, or once the transfers on it end
(one on a dead peer fails by its deadline). The next transfer opens afresh. Runs on the event loop,
in the membership view's callback and a timer per peer that left; closing is the tables' (bounded,
in the background).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from services.common.membership import MembershipChange
from services.transfer.domain import TransferId
from services.transfer.metrics import PEER_CLOSES

log = structlog.get_logger(__name__)


class ChannelCloser(Protocol):
    def close_outgoing(self, peer_address: str, incarnation: int = 0) -> int:
        """Close the channels to a gone peer life's address (those that life joined); how many."""

    def close_incoming(self, peer_id: str, incarnation: int = 0) -> int:
        """Close the channels from a gone peer life's id (those that life opened); how many."""


class ClientCloser(Protocol):
    def close_peer(self, address: str) -> int:
        """Close the clients of a gone peer (one per spelling of its address); how many."""


@dataclass(frozen=True, slots=True)
class PeerLife:
    """One process's registration as a transfer service (its `transfer/<id>` record)."""

    transfer_id: TransferId
    address: str
    host: str
    pid: int
    incarnation: int = 0  # random, chosen at the process's start (0: a peer from before the field)

    @classmethod
    def from_record(cls, transfer_id: str, record: Mapping[str, Any]) -> PeerLife:
        return cls(TransferId(transfer_id), str(record.get("address", "")), str(record.get("host", "")),
                   int(record.get("pid", 0)), int(record.get("incarnation", 0)))


def lives_of(members: Mapping[str, Mapping[str, Any]], own_id: str) -> dict[str, PeerLife]:
    """Every peer's current life, this service's own record left out."""
    return {member_id: PeerLife.from_record(member_id, record) for member_id, record in members.items()
            if member_id != own_id}


class PeerWatch:
    def __init__(self, own_id: str, channels: ChannelCloser, clients: ClientCloser,
                 members: Mapping[str, Mapping[str, Any]], incoming_grace_s: float) -> None:
        """`members`: the transfer records now (the lives this service may already hold channels to);
        `incoming_grace_s`: how long a life that left may take to register again before its incoming
        channels close (the app passes 2 x --lease-ttl-s)."""
        self._own_id = own_id
        self._channels = channels
        self._clients = clients
        self._incoming_grace_s = incoming_grace_s
        self._lives = lives_of(members, own_id)
        self._away: dict[str, tuple[PeerLife, asyncio.TimerHandle]] = {}  # lives that left, by id: incoming kept

    def on_change(self, change: MembershipChange) -> None:
        """MembershipView's callback. It compares whole views, so changes seen together (a resync after etcd
        was unreachable) are handled as well as one at a time."""
        lives = lives_of(change.members, self._own_id)
        self._check_away(lives)
        for member_id, life in self._lives.items():
            now = lives.get(member_id)
            if now is None:
                self._left(life)
            elif now != life:
                self._close(life, "restarted", is_incoming=True)
        self._lives = lives

    @property
    def num_away(self) -> int:
        """Peers that left whose incoming channels are kept until they stay away for the grace."""
        return len(self._away)

    def _left(self, life: PeerLife) -> None:
        self._close(life, "left", is_incoming=False)
        timer = asyncio.get_running_loop().call_later(self._incoming_grace_s, self._stayed_away, life)
        self._away[life.transfer_id] = (life, timer)

    def _check_away(self, lives: Mapping[str, PeerLife]) -> None:
        """A life that left and is back keeps its incoming channels; another life under its id ends them."""
        for member_id, (life, timer) in list(self._away.items()):
            if member_id not in lives:
                continue
            timer.cancel()
            del self._away[member_id]
            if lives[member_id] == life:
                log.info("peer_back", peer_transfer_id=member_id, peer=life.address, pid=life.pid)
            else:
                self._close_incoming(life, "restarted")

    def _stayed_away(self, life: PeerLife) -> None:
        if (away := self._away.get(life.transfer_id)) is not None and away[0] == life:
            del self._away[life.transfer_id]
            self._close_incoming(life, "stayed_away")

    def _close(self, life: PeerLife, why: str, is_incoming: bool) -> None:
        num_channels = self._channels.close_outgoing(life.address, incarnation=life.incarnation)
        num_clients = self._clients.close_peer(life.address)
        if is_incoming:
            num_channels += self._channels.close_incoming(life.transfer_id, incarnation=life.incarnation)
        self._log(life, why, num_channels, num_clients)

    def _close_incoming(self, life: PeerLife, why: str) -> None:
        self._log(life, why, self._channels.close_incoming(life.transfer_id, incarnation=life.incarnation), 0)

    def _log(self, life: PeerLife, why: str, num_channels: int, num_clients: int) -> None:
        PEER_CLOSES.labels("channel").inc(num_channels)
        PEER_CLOSES.labels("client").inc(num_clients)
        log.info("peer_gone", peer_transfer_id=life.transfer_id, peer=life.address, pid=life.pid, why=why,
                 num_channels_closed=num_channels, num_clients_closed=num_clients)
