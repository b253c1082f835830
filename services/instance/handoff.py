"""The last item of a migrated request's stream on its old owner: where it continues; and the
hand-offs an instance made recently."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.recent import Recent

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
    attempt: int = 0  # the frontend's attempt the moved copy belongs to (request_copy); 0: unknown


class RecentHandoffs(Recent[str, Handoff]):
    """The hand-offs made here within `max_age_s`, MAX_RECENT_HANDOFFS at the most, by request id."""

    def __init__(self, max_age_s: float) -> None:
        super().__init__(max_age_s, MAX_RECENT_HANDOFFS)
