"""The last item of a migrated request's stream on its old owner: where it continues."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Handoff:
    dst_instance_id: str
    dst_address: str  # the new owner's gRPC address: Attach there
    epoch: int  # the request's epoch on the new owner
    next_token_index: int  # the first output index the new owner streams
    migration_id: str = ""  # the migration that moved it: its key for AbortMigrateIn on the new owner
