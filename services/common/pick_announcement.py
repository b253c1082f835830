"""What a MigrateOut's source announces in the call's initial metadata once it picked: the request and the
migration's id. A caller whose deadline passes (the migration runs on at the source) reads them from its error
and asks the destination whether it holds the request under that migration id (RequestInfo.migration_id).

And in the trailing metadata of a RESOURCE_EXHAUSTED it refused with at once, before any pick: that its own
migration slots were busy (--max-concurrent-migrations), not the destination's (whose refusal it passes on
with the same status and words). The manager counts that apart: nothing was tried, no pair is to blame.

And in the trailing metadata of a RESOURCE_EXHAUSTED that came later, from a party of the migration: which one ran out
(`x-ferry-refused-by`): the destination (no free blocks, batch slot or migration slot: recorded `refused`, no fault)
or a transfer service on the way (its staging slots stayed busy: recorded `failed`, a capacity to raise)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.logging import REQUEST_ID_KEY, request_id_from_metadata

MIGRATION_ID_KEY = "x-ferry-migration-id"
SOURCE_BUSY_KEY = "x-ferry-source-busy"
SOURCE_BUSY = ((SOURCE_BUSY_KEY, "1"),)  # the trailing metadata of a source's own busy refusal
REFUSED_BY_KEY = "x-ferry-refused-by"
REFUSED_BY_DESTINATION = "destination"
REFUSED_BY_TRANSFER = "transfer"


@dataclass(frozen=True, slots=True)
class AnnouncedPick:
    request_id: str = ""  # empty: not announced (the call never reached the pick)
    migration_id: str = ""  # empty: not announced, or a source from before it was


def pick_to_metadata(request_id: str, migration_id: str) -> tuple[tuple[str, str], ...]:
    return (REQUEST_ID_KEY, request_id), (MIGRATION_ID_KEY, migration_id)


def pick_from_metadata(metadata: Any) -> AnnouncedPick:
    migration_id = next((v if isinstance(v, str) else v.decode() for k, v in metadata or () if k == MIGRATION_ID_KEY),
                        "")
    return AnnouncedPick(request_id_from_metadata(metadata) or "", migration_id)


def is_source_busy(trailing_metadata: Any) -> bool:
    """Whether a MigrateOut's status came from its source's own busy migration slots."""
    return any(key == SOURCE_BUSY_KEY for key, _ in trailing_metadata or ())


def refused_by_metadata(party: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a MigrateOut refused for want of room by `party` (REFUSED_BY_*)."""
    return ((REFUSED_BY_KEY, party),)


def refused_by(trailing_metadata: Any) -> str:
    """Which party of a MigrateOut ran out (REFUSED_BY_*); "" where the source did not say (one from before)."""
    return next((v if isinstance(v, str) else v.decode() for k, v in trailing_metadata or () if k == REFUSED_BY_KEY),
                "")
