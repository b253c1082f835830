"""Registry: this process's membership keys in etcd, under one lease that it keeps alive.

Keys are `/ferry/<cluster>/<kind>/<id>` with JSON values (kinds: `instances`, `transfer`,
`frontends`, ...). `config/*` keys are persistent (no lease): `get_json`/`put_json`.

Losing the lease never interrupts the caller's work. When renewals fail for longer than
the TTL, or etcd says the lease is gone, the registry marks itself unregistered (the
holder should stop taking new work; see `is_registered` and `on_registration_change`),
keeps trying, grants a new lease when etcd is back, and puts every entry again under
the same ids. A registered member also reads its member records back with each renewal (one etcd read): one an
operator deleted is put again at once, and one another process's lease holds now is left to it (logged
`member_id_taken`; unregistered until that one leaves), as after a lease expiry. A mark (an entry naming no
address: an instance's self-drain) is put back only after it went with a lease of ours; one deleted or written over
by someone else (an operator's Undrain or Drain) is withdrawn (`member_mark_withdrawn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog
from etcd3aio import Etcd3Client, EtcdPermissionDeniedError, EtcdUnauthenticatedError, prefix_range_end
from etcd3aio.kv import KVService

from services.common.backoff import Backoff
from services.common.errors import FailedPrecondition, Unavailable
from services.common.etcd_client import DEFAULT_RPC_TIMEOUT_S, ETCD_ERRORS, EtcdAccess, Lease, connect_etcd
from services.common.membership import MembershipView
from services.common.startup import StoppedBeforeReady

log = structlog.get_logger(__name__)

DRAIN_MARKS = "config/drain"  # `config/drain/<instance id>`: an operator drained it (the leader manager writes it)
ROLE_MARKS = "config/roles"  # `config/roles/<instance id>`: a role set at runtime (the instance writes it)

RegistrationCallback = Callable[[bool], None]
_HELD_RECHECK_S = 0.25  # register(): how often an id another lease holds is looked at again


def cluster_prefix(cluster: str) -> str:
    return f"/ferry/{cluster}/"


def _is_unreachable(exc: BaseException) -> bool:
    """Anything but a refusal of our credentials or permissions: etcd down, starting, busy or restarting
    (waiting may mend it). etcd refuses auth with INVALID_ARGUMENT ("authentication failed", "user name is
    empty") as well as UNAUTHENTICATED and PERMISSION_DENIED."""
    if isinstance(exc, (EtcdUnauthenticatedError, EtcdPermissionDeniedError)):
        return False
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() not in _REFUSALS
    return True


_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)


async def _pause(delay_s: float, stop: asyncio.Event | None) -> None:
    """Sleep `delay_s`; StoppedBeforeReady as soon as `stop` is set."""
    if stop is None:
        await asyncio.sleep(delay_s)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay_s)
    if stop.is_set():
        raise StoppedBeforeReady("stopped while waiting for etcd")


class Registry:
    """Registers this process's entries under one lease and watches other members."""

    def __init__(self, endpoints: Sequence[str], cluster: str, ttl_s: float = 5.0,
                 rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S, access: EtcdAccess | None = None) -> None:
        self.endpoints = list(endpoints)
        self.access = access  # TLS and auth of the etcd client
        self.cluster = cluster
        self.ttl_s = ttl_s
        self._rpc_timeout_s = min(rpc_timeout_s, ttl_s / 2)  # a hung etcd is noticed within the TTL
        self._client: Etcd3Client | None = None
        self._lease: Lease | None = None
        self._entries: dict[str, dict[str, Any]] = {}  # key → value this process wants in etcd
        # Marks (entries naming no address: an instance's self-drain) → the lease each was last put under. One
        # gone while that lease lives was deleted by someone (an operator's Undrain): withdrawn, never put back.
        self._mark_leases: dict[str, int] = {}
        self._needs_put = False  # entries must be written again (lease lost, or an update failed)
        # Our lease expired: while it was gone another process may have registered one of our ids
        # (a replacement started while this one was frozen). The newer process keeps the id.
        self._may_be_taken = False
        self._taken_keys: set[str] = set()  # logged as taken; logged again once it is ours
        self._lock = asyncio.Lock()  # guards _lease and writes of _entries
        self._renewed_at = 0.0  # monotonic time of the last successful grant or renewal
        self.is_registered = False
        self.num_reregistrations = 0
        self._has_registered = False
        self._callbacks: list[RegistrationCallback] = []
        self._views: list[MembershipView] = []
        self._keepalive_task: asyncio.Task[None] | None = None

    # -- keys --------------------------------------------------------------------------

    def key(self, kind: str, member_id: str) -> str:
        return f"{cluster_prefix(self.cluster)}{kind}/{member_id}"

    def prefix(self, kind: str) -> str:
        return f"{cluster_prefix(self.cluster)}{kind}/"

    @property
    def lease_id(self) -> int | None:
        return self._lease.lease_id if self._lease else None

    # -- registration ------------------------------------------------------------------

    async def wait_until_reachable(self, wait_s: float, stop: asyncio.Event | None = None) -> None:
        """At startup: return once etcd answers a read of this cluster's keys, trying for at most
        `wait_s` seconds (--etcd-wait-s); then raise Unavailable, or StoppedBeforeReady once `stop`
        is set. An etcd that refuses our credentials or permissions is reported at once: waiting
        would not mend it."""
        deadline = time.monotonic() + wait_s
        backoff = Backoff.up_to(2.0, initial_s=0.2)
        while True:
            try:
                client = await self._connect()
                await client.kv.get(cluster_prefix(self.cluster), timeout=self._rpc_timeout_s)
            except ETCD_ERRORS as exc:
                if not _is_unreachable(exc):  # refused: waiting would not mend it
                    raise FailedPrecondition(f"etcd at {','.join(self.endpoints)} refused us: {exc!r}; check "
                                             "--etcd-user/--etcd-password and the user's role") from exc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"etcd at {','.join(self.endpoints)} did not answer within --etcd-wait-s "
                                      f"{wait_s:g}: {exc!r}; check that etcd runs there (--etcd-endpoints)") from exc
                if not backoff.num_attempts:
                    log.warning("etcd_not_answering_waiting", endpoints=self.endpoints, wait_s=wait_s, error=repr(exc))
                await _pause(min(backoff.next_delay(), left), stop)
            else:
                if backoff.num_attempts:
                    log.info("etcd_answered", endpoints=self.endpoints, num_attempts=backoff.num_attempts + 1)
                return

    async def register(self, kind: str, member_id: str, value: dict[str, Any]) -> None:
        """Put the key under this registry's lease and keep it there until close().

        Raises Unavailable if etcd cannot be reached now (startup should fail fast).
        """
        client = await self._connect()
        key = self.key(kind, member_id)
        try:
            async with self._lock:
                if self._lease is None:
                    self._lease = await Lease.grant(client, self.ttl_s, self._rpc_timeout_s)
                    self._renewed_at = time.monotonic()
            await self._claim(key, value)
        except ETCD_ERRORS as exc:
            raise Unavailable(f"cannot register {key} in etcd at {','.join(self.endpoints)}: {exc!r}; "
                              "check that etcd runs there (--etcd-endpoints)") from exc
        log.info("member_registered", key=key, lease_id=f"{self._lease.lease_id:x}")
        if not self._needs_put:  # otherwise the keepalive loop is re-registering the others
            self._set_registered(True)
        if self._keepalive_task is None:
            self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name="registry_keepalive_loop")

    async def _claim(self, key: str, value: dict[str, Any]) -> None:
        """Put `key` (and keep it as ours) unless another live process holds it. A member record (one naming
        an address) held under another lease at our own address is our predecessor's, taken over at once: a
        live one would still hold that port (servers bind without SO_REUSEPORT). Any other holder is waited
        for until its lease could have run out (a crashed process's key lasts one TTL); one that still renews
        it is another live process registered under this id: FailedPrecondition, naming it, not a silent
        overwrite (both processes then answered to one id)."""
        give_up_at: float | None = None
        while True:
            async with self._lock:
                holder = await self._put_unless_held(key, value) if value.get("address") else None
                if holder is None or _holder(holder.value) == value["address"]:
                    if holder is not None or not value.get("address"):  # a predecessor's, or no member record
                        await self._put(key, value)
                    self._entries[key] = value
                    if not value.get("address"):
                        self._mark_leases[key] = self._lease.lease_id
                    return
            if give_up_at is None:
                give_up_at = time.monotonic() + await self._granted_ttl_s(holder.lease) + 1.0
                log.warning("member_id_held", key=key, holder=_holder(holder.value),
                            action="waiting for its lease to run out (a process that stopped) before registering")
            if time.monotonic() >= give_up_at:
                raise FailedPrecondition(
                    f"{key} is registered by another live process (at {_holder(holder.value)}) that keeps renewing "
                    "its lease: two processes cannot answer to one id; stop that one, or give this one another id")
            await asyncio.sleep(_HELD_RECHECK_S)

    async def _granted_ttl_s(self, lease_id: int) -> float:
        """The TTL etcd granted a lease (ours where etcd cannot say)."""
        with contextlib.suppress(*ETCD_ERRORS):
            response = await self._client.lease.time_to_live(lease_id, timeout=self._rpc_timeout_s)
            if response.grantedTTL > 0:
                return float(response.grantedTTL)
        return self.ttl_s

    def holds(self, kind: str, member_id: str) -> bool:
        """Whether register() put this entry (and unregister() did not remove it)."""
        return self.key(kind, member_id) in self._entries

    async def update(self, kind: str, member_id: str, value: dict[str, Any]) -> None:
        """Change a registered value. If etcd is unreachable the keepalive loop writes it later."""
        key = self.key(kind, member_id)
        if key not in self._entries:
            raise KeyError(f"{key} is not registered; call register() first")
        async with self._lock:
            self._entries[key] = value
            if not self.is_registered:
                return  # written on re-registration
            try:
                await self._put(key, value)
            except ETCD_ERRORS as exc:
                self._needs_put = True
                log.warning("member_update_deferred", key=key, error=repr(exc))

    async def unregister(self, kind: str, member_id: str) -> None:
        """Delete one entry (e.g. when draining); raises Unavailable if etcd cannot be reached."""
        key = self.key(kind, member_id)
        client = await self._connect()
        async with self._lock:
            self._entries.pop(key, None)
            self._mark_leases.pop(key, None)
            try:
                await client.kv.delete(key, timeout=self._rpc_timeout_s)
            except ETCD_ERRORS as exc:
                raise Unavailable(f"cannot delete {key} from etcd: {exc!r}; it expires with the lease") from exc
        log.info("member_unregistered", key=key)

    def on_registration_change(self, callback: RegistrationCallback) -> Callable[[], None]:
        """Call `callback(is_registered)` whenever registration is lost or restored."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    async def _keepalive_loop(self) -> None:
        # Renew every TTL/3. A failed renewal (whatever the error) is retried with backoff;
        # after a TTL without one the registration counts as lost. Once etcd answers again:
        # renew the old lease if it survived, else grant a new one, and write every entry again.
        # Each renewal also reads our keys back (one read): one deleted or taken is put again.
        backoff = Backoff.up_to(self.ttl_s / 3)
        while True:
            try:
                await self._renew_or_reregister()
                backoff.reset()
                await asyncio.sleep(self.ttl_s / 3)
            except Exception as exc:  # noqa: BLE001 — etcd away or anything unexpected: a failed renewal
                self._note_renew_failed(exc)
                await backoff.sleep()

    async def _renew_or_reregister(self) -> None:
        async with self._lock:
            if self._lease is not None and not await self._lease.keepalive():
                log.warning("lease_expired", lease_id=f"{self._lease.lease_id:x}")
                self._lease = None
                self._may_be_taken = True
                self._lost_registration()
            if self._lease is None:
                self._lease = await Lease.grant(self._client, self.ttl_s, self._rpc_timeout_s)
            self._renewed_at = time.monotonic()
            if self.is_registered and not self._needs_put:
                await self._check_keys()
            if (self._needs_put or not self.is_registered) and not await self._put_all():
                return  # an id of ours is another process's now: unregistered until it leaves
        self._set_registered(True)

    async def _check_keys(self) -> None:
        """Whether each of our member records (an entry naming an address) still carries our lease, in one read
        per renewal: an operator may have deleted one (`etcdctl del`), or another process put its own record over
        it. Then we are registered no more (logged) until it is ours again: put back at once where the key is free,
        and where another lease holds it, once that one leaves (as after our own lease expired). A mark (an
        instance's own drain mark) gone is left to whoever deleted it or wrote over it (an operator's Undrain, or
        Drain): withdrawn here, never put back."""
        keys = list(self._entries)
        if not keys:
            return
        response = await self._client.kv.txn(compare=[], success=[KVService.txn_op_get(key) for key in keys],
                                             timeout=self._rpc_timeout_s)
        for key, reply in zip(keys, response.responses, strict=True):
            kvs = reply.response_range.kvs
            if kvs and kvs[0].lease == self._lease.lease_id:
                continue
            if key in self._mark_leases:
                self._withdraw_mark(key, "another holds it" if kvs else "deleted")
                continue
            log.warning("member_key_lost", key=key, holder=_holder(kvs[0].value) if kvs else None,
                        reason="another lease holds it" if kvs else "deleted", action="registering again")
            self._may_be_taken = True
            self._lost_registration()

    async def _put_all(self) -> bool:
        """Write every entry; False (nothing registered) while another process holds one of our ids."""
        records = [(key, value) for key, value in self._entries.items() if key not in self._mark_leases]
        if self._may_be_taken:
            if not all([await self._put_unless_taken(key, value) for key, value in records]):
                return False
            self._may_be_taken = False
        else:
            for key, value in records:
                await self._put(key, value)
        for key in list(self._mark_leases):
            await self._put_mark(key, self._entries[key])
        if not self.is_registered and self._has_registered:
            self.num_reregistrations += 1
            log.info("members_reregistered", keys=sorted(self._entries), lease_id=f"{self._lease.lease_id:x}",
                     num_reregistrations=self.num_reregistrations)
        self._needs_put = False
        return True

    async def _put_mark(self, key: str, value: dict[str, Any]) -> None:
        """Put one of our marks again if it is still ours to put: one that went with a lease of ours that ended
        (expired while etcd was away) is put back; one deleted while the lease it was put under lived (an
        operator's Undrain) or written over by another (an operator's Drain) is withdrawn."""
        kvs = (await self._client.kv.get(key, timeout=self._rpc_timeout_s)).kvs
        if kvs and kvs[0].lease != self._lease.lease_id:
            return self._withdraw_mark(key, "another holds it")
        if not kvs and self._mark_leases[key] == self._lease.lease_id:
            return self._withdraw_mark(key, "deleted")
        created = kvs[0].create_revision if kvs else 0  # unchanged since read, or not put
        txn = await self._client.kv.txn(
            compare=[KVService.txn_compare_create_revision(key, created)],
            success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=self._lease.lease_id)],
            timeout=self._rpc_timeout_s)
        if not txn.succeeded:
            return self._withdraw_mark(key, "changed while put back")
        self._mark_leases[key] = self._lease.lease_id

    def _withdraw_mark(self, key: str, reason: str) -> None:
        """Someone else decided about our mark (an operator's Undrain deleted it, or Drain wrote over it): not ours
        any more, never put back."""
        self._entries.pop(key, None)
        self._mark_leases.pop(key, None)
        log.info("member_mark_withdrawn", key=key, reason=reason, action="left to whoever changed it")

    async def _put_unless_taken(self, key: str, value: dict[str, Any]) -> bool:
        """Put `key` unless a lease other than ours holds it: after our lease expired, that is another
        process registered under the same id (before, the process that came back overwrote it, and two
        instances answered to one id: the manager routed to one, the transfer service mapped the other)."""
        holder = await self._put_unless_held(key, value)
        if holder is None:
            self._taken_keys.discard(key)
            return True
        if key not in self._taken_keys:
            self._taken_keys.add(key)
            log.error("member_id_taken", key=key, holder=_holder(holder.value),
                      reason="another process registered this id while our lease was expired (a replacement "
                      "started while this one was frozen?); this one stays unregistered, serving what it runs, "
                      "until that one leaves: stop one of them")
        return False

    async def _put_unless_held(self, key: str, value: dict[str, Any]) -> Any | None:
        """Put `key` if it is absent or ours (None); else the key-value of the lease that holds it."""
        response = await self._client.kv.txn(
            compare=[KVService.txn_compare_create_revision(key, 0)],
            success=[KVService.txn_op_put(key, json.dumps(value, sort_keys=True), lease=self._lease.lease_id)],
            failure=[KVService.txn_op_get(key)], timeout=self._rpc_timeout_s)
        holders = [] if response.succeeded else response.responses[0].response_range.kvs
        if not holders:
            return None
        if holders[0].lease == self._lease.lease_id:
            await self._put(key, value)  # ours: write the new value
            return None
        return holders[0]

    async def _put(self, key: str, value: dict[str, Any]) -> None:
        await self._client.kv.put(key, json.dumps(value, sort_keys=True), lease=self._lease.lease_id,
                                  timeout=self._rpc_timeout_s)

    def _note_renew_failed(self, exc: BaseException) -> None:
        silent_s = time.monotonic() - self._renewed_at
        if isinstance(exc, ETCD_ERRORS):
            log.debug("lease_renew_failed", error=repr(exc), silent_s=round(silent_s, 2))
        else:  # not etcd being away: a bug or an answer we did not expect
            log.warning("lease_renew_failed", error=repr(exc), silent_s=round(silent_s, 2), exc_info=exc)
        if self.is_registered and silent_s > self.ttl_s:
            log.warning("lease_lost", error=repr(exc), silent_s=round(silent_s, 2), ttl_s=self.ttl_s)
            self._lost_registration()

    def _lost_registration(self) -> None:
        self._needs_put = True
        self._set_registered(False)

    def _set_registered(self, is_registered: bool) -> None:
        if is_registered == self.is_registered:
            return
        self.is_registered = is_registered
        self._has_registered = self._has_registered or is_registered
        for callback in list(self._callbacks):
            try:
                callback(is_registered)
            except Exception:  # noqa: BLE001 — one broken subscriber must not stop renewals
                log.exception("registration_callback_failed", callback=repr(callback))

    # -- watching and config -----------------------------------------------------------

    async def watch(self, kind: str, resync_interval_s: float = 5.0, initial_sync_timeout_s: float = 2.0
                    ) -> MembershipView:
        """A live view of `/ferry/<cluster>/<kind>/`, after its first read (or the timeout)."""
        view = MembershipView(await self._connect(), self.prefix(kind), resync_interval_s, self._rpc_timeout_s)
        view.start()
        self._views.append(view)
        if not await view.wait_synced(initial_sync_timeout_s):
            log.warning("membership_not_synced", prefix=view.prefix, timeout_s=initial_sync_timeout_s)
        return view

    async def read(self, kind: str) -> dict[str, Any]:
        """id → JSON value of everything under `/ferry/<cluster>/<kind>/` now (one read, no watch)."""
        client = await self._connect()
        prefix = self.prefix(kind)
        response = await client.kv.get(prefix, range_end=prefix_range_end(prefix), timeout=self._rpc_timeout_s)
        return {kv.key.decode().removeprefix(prefix): json.loads(kv.value) for kv in response.kvs}

    async def get_json(self, key: str) -> Any | None:
        """Value of `/ferry/<cluster>/<key>` (e.g. key="config/policy"), None if absent."""
        client = await self._connect()
        response = await client.kv.get(cluster_prefix(self.cluster) + key, timeout=self._rpc_timeout_s)
        return json.loads(response.kvs[0].value) if response.kvs else None

    async def delete_json_if(self, key: str, condition: Callable[[Any], bool]) -> bool:
        """Delete `/ferry/<cluster>/<key>` if its JSON value meets `condition`, in one transaction with
        that read (a value written in between stays). False if absent, not JSON, or kept."""
        client = await self._connect()
        full_key = cluster_prefix(self.cluster) + key
        response = await client.kv.get(full_key, timeout=self._rpc_timeout_s)
        if not response.kvs:
            return False
        raw = response.kvs[0].value
        try:
            if not condition(json.loads(raw)):
                return False
        except ValueError:
            return False
        txn = await client.kv.txn(compare=[KVService.txn_compare_value(full_key, raw)],
                                  success=[KVService.txn_op_delete(full_key)], timeout=self._rpc_timeout_s)
        return txn.succeeded

    async def put_json(self, key: str, value: Any) -> None:
        """Persistent (lease-less) put of `/ferry/<cluster>/<key>`."""
        client = await self._connect()
        await client.kv.put(cluster_prefix(self.cluster) + key, json.dumps(value, sort_keys=True),
                            timeout=self._rpc_timeout_s)

    # -- lifecycle ---------------------------------------------------------------------

    async def _connect(self) -> Etcd3Client:
        if self._client is None:
            self._client = await connect_etcd(self.endpoints, self.access)
        return self._client

    async def close(self) -> None:
        """Stop renewing, revoke the lease (deleting our keys), stop views, close the client."""
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive_task
            self._keepalive_task = None
        for view in self._views:
            await view.close()
        async with self._lock:  # an update() in flight ends first; one after it finds us unregistered
            if self._lease is not None:
                with contextlib.suppress(*ETCD_ERRORS):  # unreachable etcd: the lease expires by itself
                    await self._lease.revoke()
                log.info("lease_revoked", lease_id=f"{self._lease.lease_id:x}")
                self._lease = None
            self.is_registered = False
            if self._client is not None:
                await self._client.close()
                self._client = None

    async def __aenter__(self) -> Registry:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _holder(raw: bytes) -> str:
    """Who holds a key, for the log: its address where the value names one."""
    try:
        return str(json.loads(raw).get("address", "?"))
    except (ValueError, AttributeError):
        return "?"
