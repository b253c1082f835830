"""Cluster-wide settings the admin API changes, kept in etcd under /ferry/<cluster>/config/.

| key                  | value                                            |
|----------------------|--------------------------------------------------|
| config/policy        | {"dispatch": "load", "migration": {"enabled": true, "threshold": 1.0, "selection": "shortest_running", "pairing": "load"}} |
| config/drain/<id>    | {"instance_id": id, "drained_by": manager_id, "drained_at": unix s, "owner": "operator" or "scaler"} |
| config/roles/<id>    | a role set at runtime, written by the instance itself (instance/role_marks.py); the scaler deletes it once a retired instance is gone |

The policy's optional "scaling" entry holds the scaling band ({"enabled", "low_freeness",
"high_freeness", "min_instances", "max_instances"}). Outside config/ (no manager applies
it), the leader writes its scaling decisions to scaling/target for launchers to follow
(scaling.py).

A drain mark's owner is who set it: an operator's Drain, or the leader retiring the instance. Calling a
retirement off deletes only the scaler's mark (and one without an owner, written before owners were
recorded), so an operator's Drain of a retiring instance outlasts a burst, and so does forgetting a retired
instance once it is gone (a later instance under its id starts drained); an operator's Undrain deletes any.

Keys have no lease: they outlive every manager, so a restarted manager and a new leader
see the same policy and drain marks. Every manager runs `watch_loop`, so a change made
through any manager reaches all of them. config/ is tiny: on any event the loop re-reads
all of it rather than patching.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from etcd3aio import Etcd3Client, prefix_range_end
from etcd3aio.kv import KVService

from services.common.backoff import Backoff
from services.common.error_text import error_text, typed_error_text
from services.common.errors import Aborted, Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.registry import DRAIN_MARKS, ROLE_MARKS
from services.common.scaling_target import SCALING_TARGET_KEY, ScalingTarget
from services.manager.domain import InstanceId
from services.manager.migration import MigrationSelection, MigrationSettings
from services.manager.migration_policies import PAIRING_NAMES
from services.manager.policies import POLICY_NAMES
from services.manager.scaling import ScalingSettings

log = structlog.get_logger(__name__)

ETCD_TIMEOUT_S = 2.0
DRAIN_DELETE_TRIES = 3  # a scaler's call-off reads the mark and deletes it unless it changed meanwhile
CONFIG_RESYNC_S = 30.0  # the config watch reads everything again at least this often, change or not
POLICY_UPDATE_TRIES = 5
StoredPolicy = tuple[str | None, MigrationSettings | None, ScalingSettings | None]  # None: not stored (or unusable)
PolicyMerge = Callable[[str | None, MigrationSettings | None, ScalingSettings | None],
                       tuple[str, MigrationSettings, ScalingSettings]]


class DrainOwner(enum.Enum):
    OPERATOR = "operator"  # AdminService.Drain
    SCALER = "scaler"  # the leader retiring the instance


def drain_owner(raw: bytes) -> DrainOwner | None:
    """Who set a stored drain mark; None for a mark without an owner (or not ours to read): treated as before."""
    try:
        return DrainOwner(json.loads(raw).get("owner"))
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    dispatch_policy: str | None  # None: nothing stored yet; use --dispatch-policy
    drained: frozenset[InstanceId]
    migration: MigrationSettings | None = None  # None: nothing stored yet; use the --migration-* flags
    scaling: ScalingSettings | None = None  # None: nothing stored yet; use the --scaling-* flags


class ConfigStore:
    def __init__(self, client: Etcd3Client, cluster: str, manager_id: str) -> None:
        self.client = client
        self.manager_id = manager_id
        self._prefix = f"/ferry/{cluster}/config/"
        self.scaling_target_key = f"/ferry/{cluster}/{SCALING_TARGET_KEY}"
        self._policy_key = f"{self._prefix}policy"
        self._drain_prefix = f"/ferry/{cluster}/{DRAIN_MARKS}/"
        self._role_prefix = f"/ferry/{cluster}/{ROLE_MARKS}/"

    async def read(self) -> tuple[ClusterSettings, int]:
        """The stored settings and the etcd revision they were read at."""
        reply = await self.client.kv.get(self._prefix, range_end=prefix_range_end(self._prefix), timeout=ETCD_TIMEOUT_S)
        policy, migration, scaling, drained = None, None, None, set()
        for kv in reply.kvs:
            key = kv.key.decode()
            if key == self._policy_key:
                policy, migration, scaling = self._parse_policy(kv.value)
            elif key.startswith(self._drain_prefix):
                drained.add(InstanceId(key.removeprefix(self._drain_prefix)))
        return ClusterSettings(policy, frozenset(drained), migration, scaling), reply.header.revision

    async def update_policy(self, merge: PolicyMerge) -> StoredPolicy:
        """Put `merge(what is stored)` unless another write came in between (then merge again, up to
        POLICY_UPDATE_TRIES times): two partial SetPolicy calls at once both take effect."""
        for _ in range(POLICY_UPDATE_TRIES):
            reply = await self.client.kv.get(self._policy_key, timeout=ETCD_TIMEOUT_S)
            stored = self._parse_policy(reply.kvs[0].value) if reply.kvs else (None, None, None)
            merged = merge(*stored)
            version = reply.kvs[0].version if reply.kvs else 0
            txn = await self.client.kv.txn(
                compare=[KVService.txn_compare_version(self._policy_key, version)],
                success=[KVService.txn_op_put(self._policy_key, _policy_json(*merged))], timeout=ETCD_TIMEOUT_S)
            if txn.succeeded:
                return merged
        raise Aborted(f"policy not changed: it was changed {POLICY_UPDATE_TRIES} times while this call merged "
                      "into it; retry")

    async def put_drain(self, instance_id: InstanceId) -> None:
        """An operator's Drain."""
        await self.client.kv.put(self.drain_key(instance_id), self.drain_mark(instance_id, DrainOwner.OPERATOR),
                                 timeout=ETCD_TIMEOUT_S)

    async def delete_drain(self, instance_id: InstanceId) -> None:
        await self.client.kv.delete(self.drain_key(instance_id), timeout=ETCD_TIMEOUT_S)

    def drain_key(self, instance_id: InstanceId) -> str:
        return f"{self._drain_prefix}{instance_id}"

    def role_key(self, instance_id: InstanceId) -> str:
        return f"{self._role_prefix}{instance_id}"

    def drain_mark(self, instance_id: InstanceId, owner: DrainOwner) -> str:
        return json.dumps({"instance_id": instance_id, "drained_by": self.manager_id, "drained_at": time.time(),
                           "owner": owner.value})

    async def get_scaling_target(self) -> ScalingTarget | None:
        reply = await self.client.kv.get(self.scaling_target_key, timeout=ETCD_TIMEOUT_S)
        try:
            return ScalingTarget.from_json(json.loads(reply.kvs[0].value)) if reply.kvs else None
        except json.JSONDecodeError:
            return None

    async def put_scaling_target(self, target: ScalingTarget) -> None:
        await self.client.kv.put(self.scaling_target_key, json.dumps(target.to_json()), timeout=ETCD_TIMEOUT_S)

    def fenced_by(self, leader_key: str, epoch: Callable[[], int | None]) -> LeaderFencedStore:
        """The scaler's view of this store: its writes land only while `epoch()` is the leader key's."""
        return LeaderFencedStore(self, leader_key, epoch)

    async def watch_loop(self, apply: Callable[[ClusterSettings], None], resync_s: float = CONFIG_RESYNC_S) -> None:
        """Keep `apply`ing the stored settings: read all, watch, re-read on each change, and at least
        every `resync_s` (config/ is tiny), so a change no watch event announced is applied within that.

        On an etcd failure (or any other error, logged) the last applied settings stay in force;
        the loop backs off and starts over with a full read, so nothing written meanwhile is missed.
        """
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        while True:
            try:
                settings, revision = await self.read()
                apply(settings)
                backoff.reset()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(resync_s):
                        await self._wait_for_change(revision)
            except ETCD_ERRORS as exc:
                log.warning("config_watch_failed", error=error_text(exc))
                await backoff.sleep()
            except Exception:  # noqa: BLE001 — e.g. settings `apply` refused: keep watching for the next change
                log.exception("config_watch_crashed")
                await backoff.sleep()

    async def _wait_for_change(self, revision: int) -> None:
        watch = self.client.watch.watch(self._prefix, range_end=prefix_range_end(self._prefix),
                                         start_revision=revision + 1)
        async with contextlib.aclosing(watch):
            async for reply in watch:
                # A cancelled watch (its start revision compacted away, as after an etcd restart
                # once an hour of history has gone) sends nothing more: read everything again.
                # So does an etcd that lost its data and started over at revision 1: the watch,
                # reconnected by the client at our old revision, would skip every change until
                # the new revisions got that far.
                if reply.header.revision < revision:
                    log.warning("config_watch_revision_went_back", revision=reply.header.revision,
                                read_at=revision, action="etcd lost its data? reading config/ again")
                    return
                if reply.events or reply.canceled or reply.compact_revision:
                    return

    def _parse_policy(self, raw: bytes) -> tuple[str | None, MigrationSettings | None, ScalingSettings | None]:
        try:
            stored = json.loads(raw)
            name, migration, scaling = stored.get("dispatch"), stored.get("migration"), stored.get("scaling")
        except (json.JSONDecodeError, AttributeError):
            stored, name, migration, scaling = None, None, None, None
        if name not in POLICY_NAMES:
            log.warning("stored_policy_ignored", key=self._policy_key, value=raw.decode(errors="replace"),
                        valid=list(POLICY_NAMES))
            name = None
        return (name, self._parse_migration(migration, raw) if migration is not None else None,
                self._parse_scaling(scaling, raw) if scaling is not None else None)

    def _parse_scaling(self, value: object, raw: bytes) -> ScalingSettings | None:
        try:
            return scaling_from_json(value)
        except Exception as exc:  # noqa: BLE001 — malformed: log and keep the flags' settings
            log.warning("stored_scaling_policy_ignored", key=self._policy_key, value=raw.decode(errors="replace"),
                        error=typed_error_text(exc))
            return None

    def _parse_migration(self, value: object, raw: bytes) -> MigrationSettings | None:
        try:
            return migration_from_json(value)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("stored_migration_policy_ignored", key=self._policy_key, value=raw.decode(errors="replace"),
                        error=typed_error_text(exc))
            return None


def migration_to_json(settings: MigrationSettings) -> dict:
    return {"enabled": settings.is_enabled, "threshold": settings.threshold, "selection": settings.selection.value,
            "pairing": settings.pairing}


def migration_from_json(value: object) -> MigrationSettings:
    """The stored migration settings; ValueError, TypeError, KeyError or AttributeError when malformed."""
    threshold = float(value["threshold"])
    if threshold < 0 or value["pairing"] not in PAIRING_NAMES:
        raise ValueError(f"threshold must be >= 0 and pairing one of {', '.join(PAIRING_NAMES)}")
    return MigrationSettings(is_enabled=bool(value["enabled"]), threshold=threshold,
                             selection=MigrationSelection(value["selection"]), pairing=value["pairing"])


def scaling_to_json(settings: ScalingSettings) -> dict:
    return {"enabled": settings.is_enabled, "low_freeness": settings.low_freeness,
            "high_freeness": settings.high_freeness, "min_instances": settings.min_instances,
            "max_instances": settings.max_instances}


def scaling_from_json(value: object) -> ScalingSettings:
    """The stored scaling settings; raises when malformed or out of range."""
    settings = ScalingSettings(is_enabled=bool(value["enabled"]), low_freeness=float(value["low_freeness"]),
                               high_freeness=float(value["high_freeness"]), min_instances=int(value["min_instances"]),
                               max_instances=int(value["max_instances"]))
    settings.check()
    return settings


def _policy_json(dispatch: str, migration: MigrationSettings, scaling: ScalingSettings) -> str:
    return json.dumps({"dispatch": dispatch, "migration": migration_to_json(migration),
                       "scaling": scaling_to_json(scaling)})


class LeaderFencedStore:
    """The scaling writes of a leader, each in one transaction with the check that the leader key is
    still the one it created (create revision = its epoch): a leader deposed between two awaits (its
    lease expired while it waited on etcd; another won) writes nothing, instead of putting its stale
    target or drain marks over the new leader's. A write refused so raises Unavailable."""

    def __init__(self, store: ConfigStore, leader_key: str, epoch: Callable[[], int | None]) -> None:
        self._store = store
        self._leader_key = leader_key
        self._epoch = epoch
        self.manager_id = store.manager_id

    async def get_scaling_target(self) -> ScalingTarget | None:
        return await self._store.get_scaling_target()

    async def put_scaling_target(self, target: ScalingTarget) -> None:
        key = self._store.scaling_target_key
        await self._write("scaling target", KVService.txn_op_put(key, json.dumps(target.to_json())))

    async def put_drain(self, instance_id: InstanceId) -> None:
        """The leader retiring the instance: its mark, unless one is there already (an operator's Drain that landed
        while the tick waited on etcd stands, and so outlasts a call-off)."""
        key = self._store.drain_key(instance_id)
        op = KVService.txn_op_put(key, self._store.drain_mark(instance_id, DrainOwner.SCALER))
        if not await self._write(f"drain mark of {instance_id}", op,
                                 compare=[KVService.txn_compare_create_revision(key, 0)]):
            log.info("drain_mark_kept", instance_id=instance_id, reason="the instance is marked already")

    async def delete_drain(self, instance_id: InstanceId) -> bool:
        """A retirement called off: its drain mark goes, unless it is an operator's (a Drain of the retiring
        instance stands). False when kept."""
        return await self._delete_scalers_drain(instance_id, f"removal of the drain mark of {instance_id}")

    async def forget_retired(self, instance_id: InstanceId) -> None:
        """A retired instance is gone: its role mark goes, so a later instance with its id starts with its own
        --role, and so does the scaler's drain mark, so it serves. An operator's Drain of it stands: the later
        instance starts drained, as the operator asked, until an Undrain."""
        await self._delete_scalers_drain(instance_id, f"removal of the marks of retired {instance_id}",
                                         KVService.txn_op_delete(self._store.role_key(instance_id)))

    async def _delete_scalers_drain(self, instance_id: InstanceId, what: str, *also: object) -> bool:
        """Delete the drain mark unless it is an operator's, with `also` in the same transaction either way; False
        when the mark was kept. The mark is deleted only as read (one written meanwhile is read again)."""
        key = self._store.drain_key(instance_id)
        for _ in range(DRAIN_DELETE_TRIES):
            reply = await self._store.client.kv.get(key, timeout=ETCD_TIMEOUT_S)
            mark = reply.kvs[0].value if reply.kvs else None
            is_kept = mark is not None and drain_owner(mark) is DrainOwner.OPERATOR
            if is_kept:
                log.info("drain_mark_kept", instance_id=instance_id, owner=DrainOwner.OPERATOR.value)
            if mark is None or is_kept:
                if also:
                    await self._write(what, *also)
                return not is_kept
            if await self._write(what, KVService.txn_op_delete(key), *also,
                                 compare=[KVService.txn_compare_value(key, mark)]):
                return True
        raise Aborted(f"{what} not made: the drain mark changed {DRAIN_DELETE_TRIES} times meanwhile; the next tick "
                      "tries again")

    async def _write(self, what: str, *ops: object, compare: Sequence[object] = ()) -> bool:
        """`ops` in one transaction, only while this manager's leader key stands (else Unavailable) and
        `compare` holds (else False)."""
        epoch = self._epoch()
        if epoch is None:
            raise Unavailable(f"{what} not written: this manager does not lead now")
        txn = await self._store.client.kv.txn(
            compare=[KVService.txn_compare_create_revision(self._leader_key, epoch), *compare], success=list(ops),
            failure=[KVService.txn_op_get(self._leader_key)], timeout=ETCD_TIMEOUT_S)
        if txn.succeeded:
            return True
        leader = txn.responses[0].response_range.kvs
        if not leader or leader[0].create_revision != epoch:
            raise Unavailable(f"{what} not written: the leader key is no longer this manager's (epoch {epoch}); "
                              "another manager leads")
        return False
