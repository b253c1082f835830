"""The last item of a migrated request's stream on its old owner: where it continues; and the
hand-offs an instance made recently."""

from __future__ import annotations

import time
from dataclasses import dataclass

# Hand-offs remembered (for --migration-reservation-timeout-s, the destination's wait for an attach), so that a
# client's Abort of a request that left reaches its copy if the client never read the hand-off.
MAX_RECENT_HANDOFFS = 4096


@dataclass(frozen=True, slots=True)
class Handoff:
    dst_instance_id: str
    dst_address: str  # the new owner's gRPC address: Attach there
    epoch: int  # the request's epoch on the new owner
    next_token_index: int  # the first output index the new owner streams
    migration_id: str = ""  # the migration that moved it: its key for AbortMigrateIn on the new owner


class RecentHandoffs:
    """The hand-offs made here within `max_age_s`, MAX_RECENT_HANDOFFS at the most, by request id."""

    def __init__(self, max_age_s: float) -> None:
        self._max_age_s = max_age_s
        self._handed_off: dict[str, tuple[float, Handoff]] = {}  # request id → (monotonic, hand-off), oldest first

    def note(self, request_id: str, handoff: Handoff) -> None:
        self._handed_off.pop(request_id, None)  # re-inserted last: the dict stays oldest first
        self._handed_off[request_id] = time.monotonic(), handoff
        self._forget_old()

    def get(self, request_id: str) -> Handoff | None:
        self._forget_old()
        handed_off = self._handed_off.get(request_id)
        return None if handed_off is None else handed_off[1]

    def forget(self, request_id: str) -> None:
        self._handed_off.pop(request_id, None)

    def _forget_old(self) -> None:
        too_old = time.monotonic() - self._max_age_s
        while self._handed_off:
            request_id, (handed_off_at, _) = next(iter(self._handed_off.items()))
            if handed_off_at > too_old and len(self._handed_off) <= MAX_RECENT_HANDOFFS:
                return
            del self._handed_off[request_id]
