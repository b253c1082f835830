"""The registry's marks: entries naming no address (an instance's self-drain, `config/drain/<id>`), put under its
lease like its member records, but others decide about them too. A mark is put back only after it went with a
lease of ours; one deleted while the lease it was put under lived (an operator's Undrain) or written over by
someone else (an operator's Drain) is withdrawn (`member_mark_withdrawn`), never put back.

A mark gone when the registry comes back after its lease expired went either with the lease or before it (an
Undrain that no renewal read back before the lease ended: the renewals had stopped). etcd's history tells them
apart: the lease's expiry deletes all its keys in one revision, so a mark deleted while a member record of ours
was still under that lease went before it. Where the history is gone (etcd keeps an hour) the mark is put back.
A mark gone under the lease we are putting our keys back under (a record of ours was deleted) counts as deleted only
where etcd says, after that read, that the lease still lives: else it may have gone with the lease, which ended in
between, and is judged as above once the registry holds a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import structlog
from etcd3aio import Etcd3Client, EtcdError
from etcd3aio.kv import KVService

from services.common.member_ids import put_value

log = structlog.get_logger(__name__)

_EVENT_PUT = 0  # mvccpb.Event.EventType


class Marks:
    """Our marks → the lease each was last put under. One gone while that lease lives was deleted by someone
    (an operator's Undrain): withdrawn, never put back."""

    def __init__(self) -> None:
        self._leases: dict[str, int] = {}
        self._put_at: dict[str, int] = {}  # the revision of our last put of each: its history starts after it

    def __contains__(self, key: str) -> bool:
        return key in self._leases

    def keys(self) -> list[str]:
        return list(self._leases)

    def note(self, key: str, lease_id: int, revision: int) -> None:
        """We put `key` under `lease_id` at `revision`."""
        self._leases[key] = lease_id
        self._put_at[key] = revision

    def forget(self, key: str) -> None:
        self._leases.pop(key, None)
        self._put_at.pop(key, None)

    def withdraw(self, key: str, reason: str) -> None:
        """Someone else decided about our mark (an operator's Undrain deleted it, or Drain wrote over it): not ours
        any more, never put back."""
        self.forget(key)
        log.info("member_mark_withdrawn", key=key, reason=reason, action="left to whoever changed it")

    async def put_new(self, client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int,
                      timeout_s: float) -> bool:
        """Put a mark of ours under `lease_id` where no one else's is, in one transaction with that check: False
        (left to it, not ours) where another's is there (an operator's Drain that landed just before)."""
        txn = await client.kv.txn(
            compare=[KVService.txn_compare_create_revision(key, 0)],
            success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=lease_id)],
            failure=[KVService.txn_op_get(key)], timeout=timeout_s)
        if txn.succeeded:
            revision = txn.header.revision
        elif txn.responses[0].response_range.kvs[0].lease == lease_id:  # ours already: the new value
            revision = (await put_value(client, key, value, lease_id, timeout_s)).header.revision
        else:
            log.info("member_mark_left", key=key, reason="another's mark is there", action="left to it")
            return False
        self.note(key, lease_id, revision)
        return True

    async def put_back(self, client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int,
                       records: Sequence[str], timeout_s: float) -> str | None:
        """Put one of our marks again under `lease_id` if it is still ours to put: None once it is there; else why
        it is not ours any more (the caller withdraws it). One that went with a lease of ours that ended (expired
        while etcd was away) is put back; one deleted while the lease it was put under lived (an operator's
        Undrain; `records`: our member records' keys, which tell) or written over by another (an operator's
        Drain) is not. Raises EtcdError where `lease_id` ended as we put our keys back under it."""
        reply = await client.kv.get(key, timeout=timeout_s)
        kvs = reply.kvs
        if kvs and kvs[0].lease != lease_id:
            return "another holds it"
        if not kvs and self._leases[key] == lease_id:
            return await _deleted_under(client, lease_id, timeout_s)
        if not kvs and not await self._went_with_its_lease(client, key, records, reply.header.revision, timeout_s):
            return "deleted or written over before its lease ended"
        created = kvs[0].create_revision if kvs else 0  # unchanged since read, or not put
        txn = await client.kv.txn(
            compare=[KVService.txn_compare_create_revision(key, created)],
            success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=lease_id)],
            timeout=timeout_s)
        if not txn.succeeded:
            return "changed while put back"
        self.note(key, lease_id, txn.header.revision)
        return None

    async def _went_with_its_lease(self, client: Etcd3Client, key: str, records: Sequence[str], revision: int,
                                   timeout_s: float) -> bool:
        """Whether our mark, gone now (etcd at `revision`), went with the lease we put it under, by etcd's history:
        its first change after our put, and whether a member record of ours was still under that lease then. True
        where the history cannot say (compacted; etcd restored from older data; no record of ours)."""
        lease_id, put_at = self._leases[key], self._put_at[key]
        is_readable = records and revision > put_at
        change = await _first_change(client, key, put_at, lease_id, timeout_s) if is_readable else None
        if change is None:
            log.warning("member_mark_history_unread", key=key, put_at=put_at, revision=revision,
                     action="put back as gone with its lease")
            return True
        if change.type == _EVENT_PUT:
            return False  # written over by another (and gone since)
        at_deletion = await client.kv.txn(
            compare=[], success=[KVService.txn_op_get(record, revision=change.kv.mod_revision) for record in records],
            timeout=timeout_s)
        return not any(kv.lease == lease_id for reply in at_deletion.responses for kv in reply.response_range.kvs)


async def _deleted_under(client: Etcd3Client, lease_id: int, timeout_s: float) -> str:
    """Why our mark, put under `lease_id` (the lease we put it back under) and read as gone, is not ours: "deleted"
    while that lease lived, where etcd says after the read that it still lives. Else the lease ended since it
    carried our records just now (revoked; expired while we were frozen), maybe taking the mark with it: raises
    EtcdError, so this round fails and the next, under a new lease, reads the mark's history (_went_with_its_lease)."""
    if (await client.lease.time_to_live(lease_id, timeout=timeout_s)).TTL >= 0:  # -1: gone; 0: under a second left
        return "deleted"
    raise EtcdError(f"lease {lease_id:x} ended as our keys were put back under it; trying again under a new one")


async def _first_change(client: Etcd3Client, key: str, after: int, lease_id: int, timeout_s: float) -> Any | None:
    """The first event of `key` after revision `after` other than a put of ours (under `lease_id`); None where etcd's
    history no longer holds it (compacted) or no answer comes within `timeout_s`."""
    watch = client.watch.watch(key, start_revision=after + 1)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s), contextlib.aclosing(watch) as responses:
            async for response in responses:
                if response.canceled or response.compact_revision:
                    return None
                for event in response.events:
                    if event.type != _EVENT_PUT or event.kv.lease != lease_id:
                        return event
    return None
