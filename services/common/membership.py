"""MembershipView: the members under `/ferry/<cluster>/<kind>/`, kept current from etcd.

Design: a full read, then a watch from the revision after it until the resync interval
ends, then again. The watch makes changes visible within milliseconds; the full read
repairs whatever a watch can miss (an etcd restart, a compacted revision). While etcd is
unreachable (or a sync fails in any other way: logged, retried with backoff) the view
keeps the last known members and `staleness_s` grows; readers decide how stale is too stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import structlog
from etcd3aio import Etcd3Client, prefix_range_end

from services.common.error_text import error_text, typed_error_text
from services.common.backoff import Backoff
from services.common.etcd_client import DEFAULT_RPC_TIMEOUT_S, ETCD_ERRORS

log = structlog.get_logger(__name__)

_EVENT_PUT = 0  # mvccpb.Event.EventType
Members = Mapping[str, dict[str, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class MembershipChange:
    members: Members  # everything known after the change
    added: frozenset[str]
    removed: frozenset[str]
    updated: frozenset[str]  # same id, new value


ChangeCallback = Callable[[MembershipChange], None]


class MembershipView:
    """An up-to-date id → value dict for one kind; start with `Registry.watch(kind)`."""

    def __init__(self, client: Etcd3Client, prefix: str, resync_interval_s: float = 5.0,
                 rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self.prefix = prefix
        self._client = client
        self._resync_interval_s = resync_interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._members: Members = MappingProxyType({})  # replaced, never mutated: readers hold snapshots
        self._synced_at: float | None = None  # monotonic time of the last full read or watch event
        self._is_reachable = True
        self._changed = asyncio.Event()
        self._last_change: MembershipChange | None = None
        self._version = 0
        self._callbacks: list[ChangeCallback] = []
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def members(self) -> Members:
        return self._members

    def get(self, member_id: str) -> dict[str, Any] | None:
        return self._members.get(member_id)

    @property
    def staleness_s(self) -> float:
        """Seconds since etcd last confirmed this view (inf before the first read).

        Normally below the resync interval; grows while etcd is unreachable.
        """
        return float("inf") if self._synced_at is None else time.monotonic() - self._synced_at

    @property
    def is_synced(self) -> bool:
        return self._synced_at is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._sync_loop(), name=f"membership_sync_loop:{self.prefix}")

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait for the first full read; False if it did not happen within `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._synced.wait()
        return self._synced.is_set()

    @property
    def version(self) -> int:
        """Number of changes so far; pass it to `changed(since=...)` to miss none in between."""
        return self._version

    async def changed(self, since: int | None = None) -> MembershipChange:
        """Wait for the next change (or return at once if `version` moved past `since`).

        If several land before the waiter runs it gets the last one; read `members` for the state.
        """
        if since is None or since >= self._version:
            await self._changed.wait()
        assert self._last_change is not None
        return self._last_change

    def on_change(self, callback: ChangeCallback) -> Callable[[], None]:
        """Call `callback(change)` on the event loop after every change; returns an unsubscribe."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sync_loop(self) -> None:
        backoff = Backoff.up_to(min(2.0, self._resync_interval_s))
        while True:
            try:
                revision = await self._resync()
                await self._watch_until_resync(revision + 1)
                backoff.reset()
            except ETCD_ERRORS as exc:
                self._note_unreachable(exc)
                await backoff.sleep()
            except Exception as exc:  # noqa: BLE001 — a bug or an unexpected answer: the view must stay live
                log.warning("membership_sync_crashed", prefix=self.prefix, error=typed_error_text(exc), exc_info=exc)
                self._is_reachable = False  # the next successful read logs membership_resynced
                await backoff.sleep()

    async def _resync(self) -> int:
        response = await self._client.kv.get(self.prefix, range_end=prefix_range_end(self.prefix),
                                             timeout=self._rpc_timeout_s)
        members = {}
        for kv in response.kvs:
            member_id, value = self._decode(kv.key, kv.value)
            if value is not None:
                members[member_id] = value
        self._replace(members)
        self._mark_synced()
        return response.header.revision

    async def _watch_until_resync(self, start_revision: int) -> None:
        watch = self._client.watch.watch(self.prefix, range_end=prefix_range_end(self.prefix),
                                         start_revision=start_revision)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._resync_interval_s), contextlib.aclosing(watch) as responses:
                async for response in responses:
                    if response.canceled or response.compact_revision:
                        return  # the revision was compacted away: a full read repairs it
                    self._apply(response.events)
                    self._mark_synced()

    def _apply(self, events: Any) -> None:
        members = dict(self._members)
        for event in events:
            member_id, value = self._decode(event.kv.key, event.kv.value)
            if event.type != _EVENT_PUT:
                members.pop(member_id, None)
            elif value is not None:
                members[member_id] = value
        self._replace(members)

    def _replace(self, members: dict[str, dict[str, Any]]) -> None:
        old = self._members
        if members == old:
            return
        change = MembershipChange(
            members=MappingProxyType(members), added=frozenset(members.keys() - old.keys()),
            removed=frozenset(old.keys() - members.keys()),
            updated=frozenset(k for k in members.keys() & old.keys() if members[k] != old[k]))
        self._members = change.members
        self._notify(change)

    def _notify(self, change: MembershipChange) -> None:
        log.info("membership_changed", prefix=self.prefix, added=sorted(change.added),
                 removed=sorted(change.removed), updated=sorted(change.updated))
        self._last_change = change
        self._version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        for callback in list(self._callbacks):
            try:
                callback(change)
            except Exception:  # noqa: BLE001 — one broken subscriber must not stop the view
                log.exception("membership_callback_failed", prefix=self.prefix, callback=repr(callback))

    def _mark_synced(self) -> None:
        if not self._is_reachable:
            log.info("membership_resynced", prefix=self.prefix, num_members=len(self._members))
        self._is_reachable = True
        self._synced_at = time.monotonic()
        self._synced.set()

    def _note_unreachable(self, exc: BaseException) -> None:
        if self._is_reachable:
            log.warning("membership_sync_failed", prefix=self.prefix, error=error_text(exc),
                        num_members_kept=len(self._members))
        self._is_reachable = False

    def _decode(self, key: bytes, value: bytes) -> tuple[str, dict[str, Any] | None]:
        member_id = key.decode()[len(self.prefix):]
        if not value:
            return member_id, None
        try:
            return member_id, json.loads(value)
        except ValueError:
            log.warning("membership_value_invalid", key=key.decode(), value=value[:200].decode(errors="replace"))
            return member_id, None
