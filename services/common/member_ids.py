"""Whose a member id is in etcd: our key is put under our lease unless another lease holds it.

Another lease holding one of our ids is another process registered under it: a predecessor that stopped (its
key lasts until its lease runs out), or a replacement started while this process was frozen past its lease.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import structlog
from etcd3aio import Etcd3Client
from etcd3aio.kv import KVService

from services.common.errors import FailedPrecondition
from services.common.etcd_client import ETCD_ERRORS

log = structlog.get_logger(__name__)


async def put_value(client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int, timeout_s: float) -> Any:
    """Put `key` under the lease; etcd's PutResponse."""
    return await client.kv.put(key, json.dumps(value, sort_keys=True), lease=lease_id, timeout=timeout_s)


async def put_unless_held(client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int,
                          timeout_s: float) -> Any | None:
    """Put `key` if it is absent or ours (None); else the key-value of the lease that holds it."""
    response = await client.kv.txn(
        compare=[KVService.txn_compare_create_revision(key, 0)],
        success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=lease_id)],
        failure=[KVService.txn_op_get(key)], timeout=timeout_s)
    holders = [] if response.succeeded else response.responses[0].response_range.kvs
    if not holders:
        return None
    if holders[0].lease == lease_id:
        await put_value(client, key, value, lease_id, timeout_s)  # ours: write the new value
        return None
    return holders[0]


async def granted_ttl_s(client: Etcd3Client, lease_id: int, default_s: float, timeout_s: float) -> float:
    """The TTL etcd granted a lease (`default_s` where etcd cannot say)."""
    with contextlib.suppress(*ETCD_ERRORS):
        response = await client.lease.time_to_live(lease_id, timeout=timeout_s)
        if response.grantedTTL > 0:
            return float(response.grantedTTL)
    return default_s


def held_by_live_process(key: str, held: Any) -> FailedPrecondition:
    """register() of an id whose holder kept renewing its lease past its TTL."""
    return FailedPrecondition(
        f"{key} is registered by another live process (at {holder(held.value)}) that keeps renewing "
        "its lease: two processes cannot answer to one id; stop that one, or give this one another id")


class TakenIds:
    """Our ids another process registered while our lease was expired, each logged once while taken."""

    def __init__(self) -> None:
        self._keys: set[str] = set()  # logged as taken; logged again once it is ours

    async def put_unless_taken(self, client: Etcd3Client, key: str, value: dict[str, Any], lease_id: int,
                               timeout_s: float) -> bool:
        """Put `key` unless a lease other than ours holds it: after our lease expired, that is another
        process registered under the same id (before, the process that came back overwrote it, and two
        instances answered to one id: the manager routed to one, the transfer service mapped the other)."""
        held = await put_unless_held(client, key, value, lease_id, timeout_s)
        if held is None:
            self._keys.discard(key)
            return True
        if key not in self._keys:
            self._keys.add(key)
            log.error("member_id_taken", key=key, holder=holder(held.value),
                      reason="another process registered this id while our lease was expired (a replacement "
                      "started while this one was frozen?); this one stays unregistered, serving what it runs, "
                      "until that one leaves: stop one of them")
        return False


def holder(raw: bytes) -> str:
    """Who holds a key, for the log: its address where the value names one."""
    try:
        return str(json.loads(raw).get("address", "?"))
    except (ValueError, AttributeError):
        return "?"
