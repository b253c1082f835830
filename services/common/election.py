"""Leader election for the manager on `/ferry/<cluster>/manager/leader`.

Campaign: a transaction creates the key under this candidate's lease only if it does not
exist; otherwise watch it until it is deleted (resign, revoked or expired lease) and try
again. The leader renews its lease every TTL/3; if etcd says the lease is gone, or no
renewal succeeded for a TTL, it has lost: `is_leader` turns False and `lost` is set, and
the manager must step down (it may campaign again); so when a renewal's read-back finds the
key deleted or another's (an operator's `etcdctl del`), and then it revokes the lease, which
holds nothing now. `holds_lease` is stricter: it also turns False once a TTL has passed
since the last renewal was asked for, by the local clock, so a leader that was frozen (SIGSTOP, a stalled VM) past its TTL stops acting the
moment it runs again, before the renewal that would tell it it lost. `epoch` (the key's
create revision) grows with every new leader; use it to fence requests from a deposed one.

Followers, frontends and instances find the leader with `Election.leader()` once, or keep
a `LeaderView` (`await watch_leader(registry)`) that follows the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence

import structlog
from etcd3aio import Etcd3Client
from etcd3aio.kv import KVService

from services.common.error_text import error_text, typed_error_text
from services.common.backoff import Backoff
from services.common.cluster_keys import cluster_prefix
from services.common.etcd_client import DEFAULT_RPC_TIMEOUT_S, ETCD_ERRORS, EtcdAccess, Lease, connect_etcd
from services.common.membership import MembershipView
from services.common.registry import Registry

log = structlog.get_logger(__name__)

LEADER_KIND = "manager"
LEADER_ID = "leader"
_EVENT_DELETE = 1  # mvccpb.Event.EventType


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderInfo:
    leader_id: str  # the manager's id
    address: str  # host:port of its gRPC server
    epoch: int = 0  # create revision of the leader key: larger means newer

    def to_json(self) -> str:
        return json.dumps({"leader_id": self.leader_id, "address": self.address}, sort_keys=True)

    @classmethod
    def from_value(cls, value: dict, epoch: int = 0) -> LeaderInfo:
        return cls(leader_id=value["leader_id"], address=value["address"], epoch=epoch)


def leader_key(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}{LEADER_KIND}/{LEADER_ID}"


class Election:
    """One candidate: `await campaign()` → leader until `resign()`, `close()` or `lost`."""

    def __init__(self, endpoints: Sequence[str], cluster: str, candidate_id: str, address: str,
                 ttl_s: float = 5.0, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                 access: EtcdAccess | None = None) -> None:
        self.endpoints = list(endpoints)
        self.access = access
        self.key = leader_key(cluster)
        self.info = LeaderInfo(candidate_id, address)
        self.ttl_s = ttl_s
        self._rpc_timeout_s = min(rpc_timeout_s, ttl_s / 2)
        self._client: Etcd3Client | None = None
        self._lease: Lease | None = None
        self.epoch: int | None = None  # create revision of our key while leader
        self._lease_valid_until = float("-inf")  # monotonic: a TTL after the last grant/renewal was asked for
        self.lost = asyncio.Event()
        self._leadership_task: asyncio.Task[None] | None = None
        self._abandoned: tuple[Lease, int] | None = None  # the lease and epoch of a leadership etcd may still hold

    @property
    def is_leader(self) -> bool:
        return self.epoch is not None

    @property
    def holds_lease(self) -> bool:
        """Leader, and by our own clock the lease cannot have expired yet."""
        return self.is_leader and time.monotonic() < self._lease_valid_until

    async def campaign(self) -> None:
        """Block until this candidate is the leader (runs until then; cancel to give up)."""
        client = await self._connect()
        self.lost.clear()
        backoff = Backoff.up_to(min(2.0, self.ttl_s / 2))
        while not self.is_leader:
            try:
                await self._give_up_abandoned()
                revision = await self._try_acquire(client)
                if revision is not None:
                    await self._wait_for_vacancy(client, revision + 1)
                backoff.reset()
            except ETCD_ERRORS as exc:
                log.debug("campaign_attempt_failed", key=self.key, error=error_text(exc))
                await backoff.sleep()
            except Exception as exc:  # noqa: BLE001 — not etcd being away: a bug or an unexpected answer; try again
                log.warning("campaign_attempt_failed", key=self.key, error=error_text(exc), exc_info=exc)
                await backoff.sleep()
        log.info("leader_elected", key=self.key, leader_id=self.info.leader_id, epoch=self.epoch)
        self._leadership_task = asyncio.create_task(self._leadership_loop(), name="election_leadership_loop")

    async def leader(self) -> LeaderInfo | None:
        """The current leader, read from etcd now (raises one of ETCD_ERRORS if unreachable)."""
        client = await self._connect()
        response = await client.kv.get(self.key, timeout=self._rpc_timeout_s)
        if not response.kvs:
            return None
        return LeaderInfo.from_value(json.loads(response.kvs[0].value), response.kvs[0].create_revision)

    async def resign(self) -> None:
        """Give up leadership: delete the key (if still ours) and revoke the lease. When etcd is away the
        leadership is remembered as abandoned, so the next campaign deletes the key (as after a lost lease)."""
        await self._stop_leadership_loop()
        with contextlib.suppress(*ETCD_ERRORS):
            await self._give_up_abandoned()
        lease, epoch, self._lease, self.epoch = self._lease, self.epoch, None, None
        if lease is None:
            return
        try:
            if epoch is not None:
                await lease.client.kv.txn(
                    compare=[KVService.txn_compare_create_revision(self.key, epoch)],
                    success=[KVService.txn_op_delete(self.key)], timeout=self._rpc_timeout_s)
            await lease.revoke()
        except ETCD_ERRORS as exc:  # unreachable etcd: the lease expires by itself, unless a restart restores it
            if epoch is not None:
                self._abandoned = (lease, epoch)  # the next campaign deletes the key first
            log.info("leader_resign_failed", key=self.key, leader_id=self.info.leader_id, epoch=epoch,
                     error=error_text(exc))
            return
        log.info("leader_resigned", key=self.key, leader_id=self.info.leader_id, epoch=epoch)

    async def close(self) -> None:
        """Resign and close the client; closing again (the manager's shutdown, then its `finally`) is a no-op."""
        await self.resign()
        if self._client is not None:
            await self._client.close()
            self._client = None
        # A leadership resign() could not give up (etcd away) holds a lease on the client just closed:
        # its key expires with that lease. Kept, the next resign() or campaign() would call etcd on a
        # closed client (an AttributeError: the manager exited 1 with a traceback when stopped with etcd).
        self._abandoned = None

    async def _try_acquire(self, client: Etcd3Client) -> int | None:
        """Create the key if absent. None if we are leader now, else the revision to watch from."""
        # A fresh lease per attempt: nothing renews a candidate's lease while it waits.
        asked_at = time.monotonic()
        lease = await Lease.grant(client, self.ttl_s, self._rpc_timeout_s)
        try:
            response = await client.kv.txn(
                compare=[KVService.txn_compare_create_revision(self.key, 0)],
                success=[KVService.txn_op_put(self.key, self.info.to_json(), lease=lease.lease_id)],
                failure=[KVService.txn_op_get(self.key)], timeout=self._rpc_timeout_s)
        except ETCD_ERRORS:
            with contextlib.suppress(*ETCD_ERRORS):
                await lease.revoke()
            raise
        if response.succeeded:
            self._lease, self.epoch = lease, response.header.revision
            self._lease_valid_until = asked_at + self.ttl_s
            return None
        await lease.revoke()
        return response.header.revision

    async def _wait_for_vacancy(self, client: Etcd3Client, start_revision: int) -> None:
        # Bounded by the TTL so a missed event costs at most one TTL; then try again.
        watch = client.watch.watch(self.key, start_revision=start_revision)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl_s), contextlib.aclosing(watch) as responses:
                async for response in responses:
                    if response.canceled or any(e.type == _EVENT_DELETE for e in response.events):
                        return

    async def _leadership_loop(self) -> None:
        # Renew every TTL/3. Lost when etcd says the lease is gone, when the key is no longer
        # ours (deleted, maybe taken by another candidate: read back after each renewal), or
        # after a TTL with no successful renewal, whatever kept it from succeeding (etcd may
        # have expired it and another candidate may lead).
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                asked_at = time.monotonic()
                if not await self._lease.keepalive():
                    return self._lose_leadership("lease_expired")
                renewed_at = time.monotonic()
                self._lease_valid_until = asked_at + self.ttl_s
                if not await self._holds_key():
                    break
            except Exception as exc:  # noqa: BLE001 — etcd away or anything unexpected: a failed renewal
                _log_renew_failed(exc)
                if time.monotonic() - renewed_at > self.ttl_s:
                    return self._lose_leadership("lease_not_renewed")
        lease = self._lease
        self._lose_leadership("key_lost")
        await self._revoke_unused(lease)  # stepped down first: the revoke never holds that up

    async def _holds_key(self) -> bool:
        """Whether the leader key is still the one we created (one read per renewal): an operator may have
        deleted it (`etcdctl del`), and then another candidate took it, while our lease lives on."""
        response = await self._lease.client.kv.get(self.key, timeout=self._rpc_timeout_s)
        return bool(response.kvs) and response.kvs[0].create_revision == self.epoch

    def _lose_leadership(self, reason: str) -> None:
        log.warning("leadership_lost", key=self.key, leader_id=self.info.leader_id, epoch=self.epoch, reason=reason)
        if reason == "lease_not_renewed":  # etcd was away, and a restarted etcd restores leases for a TTL
            self._abandoned = (self._lease, self.epoch)
        self.epoch = None
        self._lease_valid_until = float("-inf")
        self._lease = None  # gone or unusable; the next campaign grants a new one
        self.lost.set()

    async def _revoke_unused(self, lease: Lease) -> None:
        """After stepping down (`lost` is set already): the lease of a leadership whose key is gone holds nothing
        now; revoke it rather than leave it to etcd for a TTL. Within the RPC timeout; a failure is only logged
        (it expires by itself)."""
        try:
            await lease.revoke()
        except ETCD_ERRORS as exc:
            log.info("unused_lease_not_revoked", lease_id=f"{lease.lease_id:x}", error=error_text(exc),
                     action="it expires by itself within its TTL")

    async def _give_up_abandoned(self) -> None:
        """Delete our leader key of a leadership we gave up while etcd was away, if etcd kept it (a
        restart restores leases with a fresh TTL): else no candidate, us included, could lead for that
        TTL. Raises one of ETCD_ERRORS while etcd is still away (the campaign tries again)."""
        if self._abandoned is None:
            return
        lease, epoch = self._abandoned
        response = await lease.client.kv.txn(
            compare=[KVService.txn_compare_create_revision(self.key, epoch)],
            success=[KVService.txn_op_delete(self.key)], timeout=self._rpc_timeout_s)
        self._abandoned = None
        await lease.revoke()
        if response.succeeded:
            log.info("abandoned_leadership_released", key=self.key, leader_id=self.info.leader_id, epoch=epoch)

    async def _stop_leadership_loop(self) -> None:
        if self._leadership_task is not None:
            self._leadership_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._leadership_task
            self._leadership_task = None

    async def _connect(self) -> Etcd3Client:
        if self._client is None:
            self._client = await connect_etcd(self.endpoints, self.access)
        return self._client


def _log_renew_failed(exc: Exception) -> None:
    if isinstance(exc, ETCD_ERRORS):
        log.debug("leader_renew_failed", error=error_text(exc))
    else:  # not etcd being away: a bug or an answer we did not expect
        log.warning("leader_renew_failed", error=error_text(exc), exc_info=exc)


class LeaderView:
    """The current leader as seen through a watch on the leader key (followers, frontends, instances).
    A value it cannot read (not a JSON object with `leader_id` and `address`) counts as no leader, so
    callers go on without one (the frontend places requests itself) instead of failing every call."""

    def __init__(self, view: MembershipView) -> None:
        self._view = view
        self._unreadable: object = None  # the last unreadable value, logged once

    @property
    def leader(self) -> LeaderInfo | None:
        value = self._view.get(LEADER_ID)
        if not value:
            return None
        try:
            return LeaderInfo.from_value(value)
        except (KeyError, TypeError, AttributeError) as exc:
            if value != self._unreadable:
                self._unreadable = value
                log.warning("leader_key_unreadable", value=repr(value)[:200], error=typed_error_text(exc))
            return None

    @property
    def staleness_s(self) -> float:
        return self._view.staleness_s

    async def changed(self) -> LeaderInfo | None:
        """Wait until the leader key changes; returns the new leader (None while there is none)."""
        while True:
            change = await self._view.changed()
            if LEADER_ID in change.added | change.removed | change.updated:
                return self.leader


async def watch_leader(registry: Registry, resync_interval_s: float = 5.0) -> LeaderView:
    return LeaderView(await registry.watch(LEADER_KIND, resync_interval_s))
