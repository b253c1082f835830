"""Who leads the managers, as this manager knows it. Only the leader dispatches and takes load reports.

The campaign (`election_loop.py`) writes it: `is_leader` from this manager's own
election (never from a watch, which may lag), `leader` from the watched leader key.
Dispatch and ReportLoad read it on every call. A standby answers UNAVAILABLE naming the
leader, so frontends fall back to local dispatch and instances reconnect their load
streams to the right manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import Unavailable


@dataclass(frozen=True, slots=True)
class Leader:
    manager_id: str
    address: str


class Leadership:
    def __init__(self, manager_id: str, address: str) -> None:
        self.me = Leader(manager_id, address)
        self.is_leader = False  # invariant: True only while this manager holds the election
        self._watched: Leader | None = None  # the leader key as last seen (None: no leader)

    @property
    def leader(self) -> Leader | None:
        return self.me if self.is_leader else self._watched

    def set_watched_leader(self, leader: Leader | None) -> None:
        self._watched = leader

    def check_leader(self) -> None:
        """Raise Unavailable (naming the leader, if known) unless this manager leads."""
        if self.is_leader:
            return
        leader = self._watched
        if leader is None or leader == self.me:  # no leader, or the key still names us after we lost
            raise Unavailable(f"manager {self.me.manager_id} is not the leader and no leader is elected yet; "
                              "dispatch locally and retry")
        raise Unavailable(f"not the leader; leader is at {leader.address} (manager {leader.manager_id})")
