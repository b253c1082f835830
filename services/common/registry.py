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
by someone else (an operator's Undrain or Drain), even just before that lease expired, is withdrawn
(`member_mark_withdrawn`; registry_marks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from etcd3aio import Etcd3Client
from etcd3aio.kv import KVService

from services.common import etcd_wait
from services.common.backoff import Backoff
from services.common.cluster_keys import ClusterKeys, cluster_prefix
from services.common.error_text import error_text
from services.common.errors import Unavailable
from services.common.etcd_client import DEFAULT_RPC_TIMEOUT_S, ETCD_ERRORS, EtcdAccess, Lease
from services.common.member_ids import (TakenIds, granted_ttl_s, held_by_live_process, holder, put_unless_held,
                                        put_value)
from services.common.registry_marks import Marks

log = structlog.get_logger(__name__)

DRAIN_MARKS = "config/drain"  # `config/drain/<instance id>`: an operator drained it (the leader manager writes it)
ROLE_MARKS = "config/roles"  # `config/roles/<instance id>`: a role set at runtime (the instance writes it)

RegistrationCallback = Callable[[bool], None]
_HELD_RECHECK_S = 0.25  # register(): how often an id another lease holds is looked at again


class Registry(ClusterKeys):
    """Registers this process's entries under one lease and watches other members."""

    def __init__(self, endpoints: Sequence[str], cluster: str, ttl_s: float = 5.0,
                 rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S, access: EtcdAccess | None = None) -> None:
        # A hung etcd is noticed within the TTL.
        super().__init__(endpoints, cluster, min(rpc_timeout_s, ttl_s / 2), access)
        self.ttl_s = ttl_s
        self._lease: Lease | None = None
        self._entries: dict[str, dict[str, Any]] = {}  # key → value this process wants in etcd
        self._marks = Marks()  # entries naming no address (an instance's self-drain): see registry_marks.py
        self._needs_put = False  # entries must be written again (lease lost, or an update failed)
        # Our lease expired: while it was gone another process may have registered one of our ids
        # (a replacement started while this one was frozen). The newer process keeps the id.
        self._may_be_taken = False
        self._taken = TakenIds()
        self._lock = asyncio.Lock()  # guards _lease and writes of _entries
        self._renewed_at = 0.0  # monotonic time of the last successful grant or renewal
        self._lease_valid_until = float("-inf")  # monotonic: a TTL after the last grant or renewal was asked for
        self._is_registered = False  # as the keepalive loop last found it (is_registered adds the local clock)
        self.num_reregistrations = 0
        self._has_registered = False
        self._callbacks: list[RegistrationCallback] = []
        self._keepalive_task: asyncio.Task[None] | None = None

    @property
    def lease_id(self) -> int | None:
        return self._lease.lease_id if self._lease else None

    @property
    def is_registered(self) -> bool:
        """Registered, and by our own clock the lease cannot have expired yet: a process frozen past its TTL
        (SIGSTOP, a stalled VM) is unregistered the moment it runs again, before the renewal that would tell it
        (as `Election.holds_lease`). Whoever acts under our ids outside etcd (load reports) asks this."""
        return self._is_registered and time.monotonic() < self._lease_valid_until

    # -- registration ------------------------------------------------------------------

    async def wait_until_reachable(self, wait_s: float, stop: asyncio.Event | None = None) -> None:
        """At startup: return once etcd answers a read of this cluster's keys, trying for at most
        `wait_s` seconds (--etcd-wait-s); then raise Unavailable, or StoppedBeforeReady once `stop`
        is set. An etcd that refuses our credentials or permissions is reported at once: waiting
        would not mend it."""
        await etcd_wait.wait_until_reachable(self._connect, self.endpoints, cluster_prefix(self.cluster), wait_s,
                                             self._rpc_timeout_s, stop)

    async def register(self, kind: str, member_id: str, value: dict[str, Any]) -> bool:
        """Put the key under this registry's lease and keep it there until close(). False for a mark (a value naming
        no address) where another's mark is there already: left to it, not held.

        Raises Unavailable if etcd cannot be reached now (startup should fail fast). A lease the local clock says may
        have ended (the process was frozen past its TTL) is renewed first, or replaced and every entry put again.
        """
        client = await self._connect()
        key = self.key(kind, member_id)
        try:
            if self._keepalive_task is not None and time.monotonic() >= self._lease_valid_until:
                await self._renew_or_reregister()  # frozen past the TTL: not under a lease etcd may have ended
            async with self._lock:
                if self._lease is None:
                    await self._grant(client)
            is_held = await self._claim(key, value)
        except ETCD_ERRORS as exc:
            raise Unavailable(f"cannot register {key} in etcd at {','.join(self.endpoints)}: {error_text(exc)}; "
                              "check that etcd runs there (--etcd-endpoints)") from exc
        if is_held:
            log.info("member_registered", key=key, lease_id=f"{self._lease.lease_id:x}")
        if not self._needs_put:  # otherwise the keepalive loop is re-registering the others
            self._set_registered(True)
        if self._keepalive_task is None:
            self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name="registry_keepalive_loop")
        return is_held

    async def _claim(self, key: str, value: dict[str, Any]) -> bool:
        """Put `key` (and keep it as ours) unless another live process holds it; a mark, unless another's is
        there (False). A member record (one naming an address) held under another lease at our own address is
        our predecessor's, taken over at once: a live one would still hold that port (servers bind without
        SO_REUSEPORT). Any other holder is waited for until its lease could have run out (a crashed process's
        key lasts one TTL); one that still renews it is another live process registered under this id:
        FailedPrecondition, naming it, not a silent overwrite (both processes then answered to one id)."""
        give_up_at: float | None = None
        while True:
            async with self._lock:
                if not value.get("address"):  # a mark
                    is_held = await self._marks.put_new(self._client, key, value, self._lease.lease_id,
                                                        self._rpc_timeout_s)
                    if is_held:
                        self._entries[key] = value
                    return is_held
                held = await put_unless_held(self._client, key, value, self._lease.lease_id, self._rpc_timeout_s)
                if held is None or holder(held.value) == value["address"]:
                    if held is not None:  # a predecessor's record
                        await self._put(key, value)
                    self._entries[key] = value
                    return True
            if give_up_at is None:
                ttl_s = await granted_ttl_s(self._client, held.lease, self.ttl_s, self._rpc_timeout_s)
                give_up_at = time.monotonic() + ttl_s + 1.0
                log.warning("member_id_held", key=key, holder=holder(held.value),
                            action="waiting for its lease to run out (a process that stopped) before registering")
            if time.monotonic() >= give_up_at:
                raise held_by_live_process(key, held)
            await asyncio.sleep(_HELD_RECHECK_S)
            await self._renew_while_waiting()

    async def _renew_while_waiting(self) -> None:
        """register() waiting out another's lease keeps ours meanwhile: before the first registration no keepalive
        loop runs, and the wait (the holder's TTL and a second) outlived our lease: the put after it failed
        ('requested lease not found'), and a process restarted on another port exited naming etcd as unreachable."""
        if self._keepalive_task is not None or time.monotonic() - self._renewed_at < self.ttl_s / 3:
            return
        async with self._lock:
            asked_at = time.monotonic()
            if await self._lease.keepalive():
                self._note_renewed(asked_at)

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
            if not self._is_registered:
                return  # written on re-registration
            try:
                await self._put(key, value)
            except ETCD_ERRORS as exc:
                self._needs_put = True
                log.warning("member_update_deferred", key=key, error=error_text(exc))

    async def unregister(self, kind: str, member_id: str) -> None:
        """Delete one entry (e.g. when draining) where it is still ours: one under another lease (another process
        registered our id while our lease was expired) stays. Raises Unavailable if etcd cannot be reached."""
        key = self.key(kind, member_id)
        client = await self._connect()
        async with self._lock:
            self._entries.pop(key, None)
            self._marks.forget(key)
            try:
                kvs = (await client.kv.get(key, timeout=self._rpc_timeout_s)).kvs
                if kvs and self._lease is not None and kvs[0].lease == self._lease.lease_id:
                    await client.kv.txn(compare=[KVService.txn_compare_create_revision(key, kvs[0].create_revision)],
                                        success=[KVService.txn_op_delete(key)], timeout=self._rpc_timeout_s)
            except ETCD_ERRORS as exc:
                raise Unavailable(f"cannot delete {key} from etcd: {error_text(exc)}; it expires with the lease") from exc
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
            asked_at = time.monotonic()
            if self._lease is not None and not await self._lease.keepalive():
                log.warning("lease_expired", lease_id=f"{self._lease.lease_id:x}")
                self._lease = None
                self._may_be_taken = True
                self._lost_registration()
            if self._lease is None:
                await self._grant(self._client)
            else:
                self._note_renewed(asked_at)
            if self._is_registered and not self._needs_put:
                await self._check_keys()
            if (self._needs_put or not self._is_registered) and not await self._put_all():
                return  # an id of ours is another process's now: unregistered until it leaves
        self._set_registered(True)

    async def _check_keys(self) -> None:
        """Whether each of our member records (an entry naming an address) still carries our lease, in one read
        per renewal: an operator may have deleted one (`etcdctl del`), or another process put its own record over
        it. Then we are registered no more (logged) until it is ours again: put back at once where the key is free,
        and where another lease holds it, once that one leaves (as after our own lease expired). A mark (an
        instance's own drain mark) gone while this read shows our records under the lease is left to whoever
        deleted it or wrote over it (an operator's Undrain, or Drain): withdrawn here, never put back. Records
        gone too may mean the lease ended since its renewal (revoked; expired while we were frozen): the marks are
        judged with the records put back (registry_marks.py)."""
        keys = list(self._entries)
        if not keys:
            return
        response = await self._client.kv.txn(compare=[], success=[KVService.txn_op_get(key) for key in keys],
                                             timeout=self._rpc_timeout_s)
        gone_marks: list[tuple[str, str]] = []
        for key, reply in zip(keys, response.responses, strict=True):
            kvs = reply.response_range.kvs
            if kvs and kvs[0].lease == self._lease.lease_id:
                continue
            if key in self._marks:
                gone_marks.append((key, "another holds it" if kvs else "deleted"))
                continue
            log.warning("member_key_lost", key=key, holder=holder(kvs[0].value) if kvs else None,
                        reason="another lease holds it" if kvs else "deleted", action="registering again")
            self._may_be_taken = True
            self._lost_registration()
        if not self._needs_put:  # every record under the lease at this read: the lease lived when the marks went
            for key, reason in gone_marks:
                self._withdraw_mark(key, reason)

    async def _put_all(self) -> bool:
        """Write every entry; False (nothing registered) while another process holds one of our ids."""
        records = [(key, value) for key, value in self._entries.items() if key not in self._marks]
        if self._may_be_taken:
            if not all([await self._taken.put_unless_taken(self._client, key, value, self._lease.lease_id,
                                                           self._rpc_timeout_s) for key, value in records]):
                return False
            self._may_be_taken = False
        else:
            for key, value in records:
                await self._put(key, value)
        for key in self._marks.keys():
            if (reason := await self._marks.put_back(self._client, key, self._entries[key], self._lease.lease_id,
                                                     [record for record, _ in records], self._rpc_timeout_s)) is not None:
                self._withdraw_mark(key, reason)
        if not self._is_registered and self._has_registered:
            self.num_reregistrations += 1
            log.info("members_reregistered", keys=sorted(self._entries), lease_id=f"{self._lease.lease_id:x}",
                     num_reregistrations=self.num_reregistrations)
        self._needs_put = False
        return True

    def _withdraw_mark(self, key: str, reason: str) -> None:
        self._entries.pop(key, None)
        self._marks.withdraw(key, reason)

    async def _grant(self, client: Etcd3Client) -> None:
        asked_at = time.monotonic()
        self._lease = await Lease.grant(client, self.ttl_s, self._rpc_timeout_s)
        self._note_renewed(asked_at)

    def _note_renewed(self, asked_at: float) -> None:
        """etcd granted or renewed the lease we asked for at `asked_at`: it lives at least a TTL from then."""
        self._renewed_at = time.monotonic()
        self._lease_valid_until = asked_at + self.ttl_s

    async def _put(self, key: str, value: dict[str, Any]) -> Any:
        return await put_value(self._client, key, value, self._lease.lease_id, self._rpc_timeout_s)

    def _note_renew_failed(self, exc: BaseException) -> None:
        silent_s = time.monotonic() - self._renewed_at
        if isinstance(exc, ETCD_ERRORS):
            log.debug("lease_renew_failed", error=error_text(exc), silent_s=round(silent_s, 2))
        else:  # not etcd being away: a bug or an answer we did not expect
            log.warning("lease_renew_failed", error=error_text(exc), silent_s=round(silent_s, 2), exc_info=exc)
        if self._is_registered and silent_s > self.ttl_s:
            log.warning("lease_lost", error=error_text(exc), silent_s=round(silent_s, 2), ttl_s=self.ttl_s)
            self._lost_registration()

    def _lost_registration(self) -> None:
        self._needs_put = True
        self._set_registered(False)

    def _set_registered(self, is_registered: bool) -> None:
        if is_registered == self._is_registered:
            return
        self._is_registered = is_registered
        self._has_registered = self._has_registered or is_registered
        for callback in list(self._callbacks):
            try:
                callback(is_registered)
            except Exception:  # noqa: BLE001 — one broken subscriber must not stop renewals
                log.exception("registration_callback_failed", callback=repr(callback))

    # -- lifecycle ---------------------------------------------------------------------

    async def _revoke_lease(self, lease: Lease) -> None:
        """Revoke `lease`, deleting our keys at once; an etcd that does not answer leaves them to the lease's TTL
        (counted again from when etcd serves again, if it was down), which the log then says."""
        try:
            await lease.revoke()
        except ETCD_ERRORS as exc:
            log.warning("lease_not_revoked", lease_id=f"{lease.lease_id:x}", error=error_text(exc),
                        expires_within_s=self.ttl_s)
            return
        log.info("lease_revoked", lease_id=f"{lease.lease_id:x}")

    async def close(self) -> None:
        """Stop renewing, revoke the lease (deleting our keys), stop views, close the client."""
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive_task
            self._keepalive_task = None
        await self._close_views()
        async with self._lock:  # an update() in flight ends first; one after it finds us unregistered
            if self._lease is not None:
                await self._revoke_lease(self._lease)
                self._lease = None
            self._is_registered = False
            await self._close_client()
