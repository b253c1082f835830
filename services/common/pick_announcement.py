"""What a MigrateOut's source announces in the call's initial metadata once it picked: the request and the
migration's id. A caller whose deadline passes (the migration runs on at the source) reads them from its error
and asks the destination whether it holds the request under that migration id (RequestInfo.migration_id)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.logging import REQUEST_ID_KEY, request_id_from_metadata

MIGRATION_ID_KEY = "x-ferry-migration-id"


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
