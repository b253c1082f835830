"""Who leads the managers, as this manager knows it. Only the leader dispatches and takes load reports.

The campaign (`election_loop.py`) writes it: whether this manager won its own election
(never from a watch, which may lag), and `leader` from the watched leader key.
`is_leader` also asks the election whether the lease is still surely valid by the local
clock, so a leader frozen past its TTL dispatches and migrates nothing once it wakes.
Dispatch and ReportLoad read it on every call. A standby answers UNAVAILABLE naming the
leader, so frontends fall back to local dispatch and instances reconnect their load
streams to the right manager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import Unavailable


@dataclass(frozen=True, slots=True)
class Leader:
    manager_id: str
    address: str


class Leadership:
    def __init__(self, manager_id: str, address: str, holds_lease: Callable[[], bool] = lambda: True,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.me = Leader(manager_id, address)
        self._is_elected = False  # invariant: True only while this manager holds the election
        self._holds_lease = holds_lease  # Election.holds_lease
        self._wall_clock = wall_clock
        self._watched: Leader | None = None  # the leader key as last seen (None: no leader)
        self.term = 0  # counts this manager's elections: what a term read from etcd holds only for that term
        self.elected_at = 0.0  # unix seconds when the term began: what began before it is an earlier term's

    @property
    def is_leader(self) -> bool:
        return self._is_elected and self._holds_lease()

    def set_elected(self, is_elected: bool) -> None:
        if is_elected and not self._is_elected:
            self.term += 1
            self.elected_at = self._wall_clock()
        self._is_elected = is_elected

    @property
    def leader(self) -> Leader | None:
        """This manager while it leads; else the leader key as last seen, except a key that still names this
        manager after it lost (etcd away past the lease TTL: no manager leads until the key changes)."""
        if self.is_leader:
            return self.me
        return None if self._watched == self.me else self._watched

    def set_watched_leader(self, leader: Leader | None) -> None:
        self._watched = leader

    def check_leader(self) -> None:
        """Raise Unavailable (naming the leader, if known) unless this manager leads."""
        if self.is_leader:
            return
        leader = self.leader
        if leader is None:  # no leader, or the key still names us after we lost
            raise Unavailable(f"manager {self.me.manager_id} is not the leader and no leader is elected yet; "
                              "dispatch locally and retry")
        raise Unavailable(f"not the leader; leader is at {leader.address} (manager {leader.manager_id})")
