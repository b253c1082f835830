"""The registry's marks: entries naming no address (an instance's self-drain, `config/drain/<id>`), put under its
lease like its member records, but others decide about them too. A mark is put back only after it went with a
lease of ours; one deleted while the lease it was put under lived (an operator's Undrain) or written over by
someone else (an operator's Drain) is withdrawn (`member_mark_withdrawn`), never put back.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from etcd3aio import Etcd3Client
from etcd3aio.kv import KVService

log = structlog.get_logger(__name__)


class Marks:
    """Our marks → the lease each was last put under. One gone while that lease lives was deleted by someone
    (an operator's Undrain): withdrawn, never put back."""

    def __init__(self) -> None:
        self._leases: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._leases

    def keys(self) -> list[str]:
        return list(self._leases)

    def note(self, key: str, lease_id: int) -> None:
        """`key` is in etcd under `lease_id` now (we put it)."""
        self._leases[key] = lease_id

    def forget(self, key: str) -> None:
        self._leases.pop(key, None)

    def withdraw(self, key: str, reason: str) -> None:
        """Someone else decided about our mark (an operator's Undrain deleted it, or Drain wrote over it): not ours
        any more, never put back."""
        self.forget(key)
        log.info("member_mark_withdrawn", key=key, reason=reason, action="left to whoever changed it")

    async def put_back(self, client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int,
                       timeout_s: float) -> str | None:
        """Put one of our marks again under `lease_id` if it is still ours to put: None once it is there; else why
        it is not ours any more (the caller withdraws it). One that went with a lease of ours that ended (expired
        while etcd was away) is put back; one deleted while the lease it was put under lived (an operator's
        Undrain) or written over by another (an operator's Drain) is not."""
        kvs = (await client.kv.get(key, timeout=timeout_s)).kvs
        if kvs and kvs[0].lease != lease_id:
            return "another holds it"
        if not kvs and self._leases[key] == lease_id:
            return "deleted"
        created = kvs[0].create_revision if kvs else 0  # unchanged since read, or not put
        txn = await client.kv.txn(
            compare=[KVService.txn_compare_create_revision(key, created)],
            success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=lease_id)],
            timeout=timeout_s)
        if not txn.succeeded:
            return "changed while put back"
        self.note(key, lease_id)
        return None
