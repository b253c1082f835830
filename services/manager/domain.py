"""Domain objects of the manager: instances as etcd records them, load reports, dispatch asks.

Nothing here knows about gRPC or etcd clients; `convert.py` maps these to and from protos.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

InstanceId = NewType("InstanceId", str)

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block when an instance's record has no KV geometry


class Role(enum.Enum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


PREFILL_ROLES = frozenset({Role.BOTH, Role.PREFILL})  # take new requests
DECODE_ROLES = frozenset({Role.DECODE})  # take prefilled requests by the PD hand-off (BOTH only as a fallback)
ALL_ROLES = frozenset(Role)


class InstanceState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """What an instance wrote under /ferry/<cluster>/instances/<id> (its etcd registration)."""

    instance_id: InstanceId
    address: str
    role: Role = Role.BOTH
    model: str = ""
    pid: int = 0
    host: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0
    max_num_seqs: int = 0  # batch slots (its --max-num-seqs); 0: not in the record (an older instance)
    max_model_len: int = 0  # longest sequence (prompt + output) it serves; 0: not in the record
    is_draining: bool = False  # the instance itself says it takes no new work (record state "draining")
    kv_layout: tuple = ()  # (layers, kv heads, head dim, block size, dtype) of its KV cache; (): not in the record
    vocab_size: int = 0  # its model's vocabulary; 0: not in the record (an older instance)
    model_fingerprint: str = ""  # a hash of its weights (model_fingerprint.py); "": not in the record, or no weights
    # Its model's sliding window where every layer has one (a request holds only that window's KV blocks); 0: none,
    # or not in the record (an older instance)
    kv_window_tokens: int = 0

    def holds_same_model(self, other: InstanceRecord) -> bool:
        """Whether requests can move between the two: blocks copy only between caches of one layout (else the
        copy fails, "kv geometry mismatch"), token ids mean the same only under one vocabulary, and a request
        goes on as it began only on the same weights (two fine-tunes of one base share layout and vocabulary:
        their fingerprints differ). What a record does not say (an older instance's) is taken as the same."""
        return ((not self.kv_layout or not other.kv_layout or self.kv_layout == other.kv_layout)
                and (not self.vocab_size or not other.vocab_size or self.vocab_size == other.vocab_size)
                and (not self.model_fingerprint or not other.model_fingerprint
                     or self.model_fingerprint == other.model_fingerprint))

    @property
    def can_prefill(self) -> bool:
        """New requests go to prefill-capable instances; decode-only ones get work by migration."""
        return self.role is not Role.DECODE

    @classmethod
    def from_json(cls, instance_id: str, raw: bytes | str) -> InstanceRecord:
        """Parse a registration; ValueError names what is wrong with it."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"instance {instance_id}: record is not JSON ({exc})") from None
        return cls.from_dict(instance_id, data)

    @classmethod
    def from_dict(cls, instance_id: str, data: Any) -> InstanceRecord:
        """Build from the decoded JSON of a registration; ValueError names what is wrong with it."""
        if not isinstance(data, dict) or not data.get("address"):
            raise ValueError(f"instance {instance_id}: record has no address")
        try:
            role = Role(str(data.get("role") or "both").lower())
        except ValueError:
            raise ValueError(f"instance {instance_id}: role {data.get('role')!r} is not both, prefill or decode") from None
        kv = data.get("kv") or {}
        try:
            return cls(
                instance_id=InstanceId(instance_id), address=str(data["address"]), role=role,
                model=str(data.get("model", "")), pid=int(data.get("pid") or 0), host=str(data.get("host", "")),
                block_size=int(kv.get("block_size") or DEFAULT_BLOCK_SIZE), num_blocks=int(kv.get("num_blocks") or 0),
                max_num_seqs=max(int(data.get("max_num_seqs") or 0), 0),  # a hand-edited negative: not known
                max_model_len=max(int(data.get("max_model_len") or 0), 0),
                is_draining=str(data.get("state", "")).lower() == "draining",
                kv_layout=tuple(kv.get(k) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"))
                if kv else (),
                vocab_size=max(int(data.get("vocab_size") or 0), 0),
                model_fingerprint=str(data.get("model_fingerprint") or ""),
                kv_window_tokens=max(int(data.get("kv_window_tokens") or 0), 0),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"instance {instance_id}: malformed record ({exc})") from None


def serves_shorter(src_max_model_len: int, dst_max_model_len: int) -> bool:
    """Does the destination serve shorter sequences than the source (both known)? It refuses each of the
    source's requests that may grow past its limit, whatever its free blocks."""
    return 0 < dst_max_model_len < src_max_model_len


@dataclass(frozen=True, slots=True)
class Load:
    """One load report of an instance (or the load the manager assumes for it)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_blocks_needed_by_waiting: int = 0
    num_requests_served: int = 0
    num_prefilled: int = 0  # decoding requests on a PREFILL instance waiting for their PD hand-off
    num_prefix_queried_tokens: int = 0  # prefix cache since the instance started: admitted context tokens
    num_prefix_hit_tokens: int = 0  # ... and those found in the cache
    num_headroom_blocks: int = 0  # kept free for the instance's high-priority requests
    num_incoming_migrations: int = 0  # reserved or committed-not-attached migrations into the instance
    # Taken in since the instance started (cumulative; 0 from an older instance, which does not count):
    num_requests_admitted: int = 0  # by Generate
    num_requests_migrated_in: int = 0  # by a committed migration in (a PD hand-off or any other)
    num_free_slots: int | None = None  # batch slots a request moved in would find free; None: not reported
    num_suspended: int = 0  # out of the batch, neither running nor waiting: parked for a PD hand-off, or migrating out
    # Its migration slots free (--max-concurrent-migrations, one pool for migrations in and out): what a MigrateOut
    # to or from it would find; None: not reported (an older instance)
    num_free_migration_out_slots: int | None = None
    num_preemptions: int = 0  # running requests sent back to its queue to free KV blocks since it started

    @property
    def num_held(self) -> int:
        """Requests the instance holds: running, waiting, or suspended (0: it may be stopped)."""
        return self.num_running + self.num_waiting + self.num_suspended

    @property
    def freeness(self) -> float:
        """(free blocks - blocks needed by queued requests - priority headroom) / (running requests + 1)."""
        num_spoken_for = self.num_blocks_needed_by_waiting + self.num_headroom_blocks
        return (self.num_free_blocks - num_spoken_for) / (self.num_running + 1)

    @property
    def has_free_slot(self) -> bool:
        """A request sent or moved here would find a batch slot; True where not reported (an older instance)."""
        return self.num_free_slots is None or self.num_free_slots > 0

    @property
    def has_free_migration_slot(self) -> bool:
        """A migration out of it or into it would find a migration slot free (one pool serves both: its
        PrepareMigrateIn is refused RESOURCE_EXHAUSTED without one); True where not reported (an older instance)."""
        return self.num_free_migration_out_slots is None or self.num_free_migration_out_slots > 0

    def has_room_for(self, num_blocks: int) -> bool:
        """A request holding `num_blocks` moved here would find them free (after what queued requests and the
        manager's reservations need) and a batch slot; otherwise it refuses the move (RESOURCE_EXHAUSTED)."""
        return self.num_free_blocks - self.num_blocks_needed_by_waiting >= num_blocks and self.has_free_slot

    def plus(self, reservation: Reservation) -> Load:
        """This load with the manager's not-yet-reported dispatches and migrations in added."""
        if not reservation.num_requests:
            return self
        num_free_slots = (None if self.num_free_slots is None
                          else max(self.num_free_slots - reservation.num_requests, 0))
        num_free_migration_slots = (None if self.num_free_migration_out_slots is None
                                    else max(self.num_free_migration_out_slots - reservation.num_migrations, 0))
        return dataclasses.replace(self, num_running=self.num_running + reservation.num_requests,
                                   num_blocks_needed_by_waiting=self.num_blocks_needed_by_waiting
                                   + reservation.num_blocks, num_free_slots=num_free_slots,
                                   num_free_migration_out_slots=num_free_migration_slots)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Requests placed on an instance (dispatched, or migrating in) that its last load report does not count yet."""

    num_requests: int = 0
    num_blocks: int = 0
    num_migrations: int = 0  # of those, migrations in (by this manager): each also holds one of its migration slots

    def __add__(self, other: Reservation) -> Reservation:
        return Reservation(self.num_requests + other.num_requests, self.num_blocks + other.num_blocks,
                           self.num_migrations + other.num_migrations)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A serving instance as a dispatch policy sees it: its last load plus reservations."""

    instance_id: InstanceId
    address: str
    load: Load
    freeness: float  # load.freeness, computed once: policies compare it many times

    @classmethod
    def of(cls, instance_id: InstanceId, address: str, load: Load) -> Candidate:
        return cls(instance_id, address, load, load.freeness)


@dataclass(frozen=True, slots=True)
class DispatchAsk:
    """A frontend's question: where should this request run?"""

    request_id: str
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    priority: int = 0
    exclude_instance_ids: frozenset[InstanceId] = field(default_factory=frozenset)
    prefix_chunk_keys: tuple[int, ...] = ()  # chained hashes of the prompt's chunks (prefix_hash.py), first first

    def num_prompt_blocks(self, block_size: int, kv_window_tokens: int = 0) -> int:
        """KV blocks the prompt fills (plus the slot of the first generated token); with a sliding window of
        `kv_window_tokens` on every layer (0: none), no more than the instance holds for one request at once:
        the window's blocks and one more (services/instance/engine/block_manager.max_blocks_held)."""
        block_size = max(block_size, 1)
        num_blocks = math.ceil((max(self.num_prompt_tokens, 0) + 1) / block_size)
        if kv_window_tokens <= 0:
            return num_blocks
        return min(num_blocks, math.ceil(kv_window_tokens / block_size) + 1)


@dataclass(frozen=True, slots=True)
class Placement:
    """Dispatch's answer."""

    instance_id: InstanceId
    address: str
    policy: str
    can_prefill_on_decode: bool = False  # a DECODE instance chosen on purpose (no prefill serves, short prompt)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as the admin API shows it."""

    record: InstanceRecord
    state: InstanceState
    load: Load  # last report plus reservations
    num_dispatched: int
    report_age_s: float | None  # None: no report received yet
    is_heard: bool = True  # it reported within --report-timeout-s (and no peer found it unreachable since)
    num_migrations: int = 0  # migrations this manager runs into or out of it now
    reported_load: Load | None = None  # the last report alone (None: as `load`)
    # Migrations of this manager into it that `load` holds and no report of it shows yet: (source, blocks) each
    migrating_in_from: tuple[tuple[InstanceId, int], ...] = ()

    @property
    def held_load(self) -> Load:
        """What it holds now, per its last report: the requests a migration can take from it."""
        return self.load if self.reported_load is None else self.reported_load

    @property
    def is_drained(self) -> bool:
        """DRAINING, a recent report shows nothing running, waiting or suspended (parked for a PD hand-off, or
        moving out in a migration a previous leader started), and no migration of ours moves a request into or
        out of it: safe to stop. (A report older than the timeout proves nothing: a standby may hold one from
        the term it led.)"""
        return (self.state is InstanceState.DRAINING and self.report_age_s is not None and self.is_heard
                and self.load.num_held == 0 and self.load.num_incoming_migrations == 0 and self.num_migrations == 0)


def migrations_within(views: Sequence[InstanceView]) -> list[int]:
    """The blocks of each migration of ours in flight between two of `views` that its destination's load holds
    (no report there shows it yet): its source's report counts the request meanwhile."""
    ids = {v.record.instance_id for v in views}
    return [num_blocks for v in views for src_id, num_blocks in v.migrating_in_from if src_id in ids]


def pooled_freeness(views: Sequence[InstanceView]) -> float:
    """The instances' freeness as if they were one instance: every free block (less what queued
    requests need) over every running request, plus one per instance. Not the mean of their
    freeness: an empty instance (its free blocks over 1) beside a backed-up one would make the
    cluster look idle, and a just-added instance would be retired at once, over and over.
    A migration in flight between two of them is counted once, where its source's report counts it: the
    destination's hold of it (a running request and its blocks, until a report there shows it) is left out.
    Counted on both, a burst of moves looked like more load than there was, and scaling keeps this in a band."""
    within = migrations_within(views)
    free = sum(v.load.num_free_blocks - v.load.num_blocks_needed_by_waiting for v in views) + sum(within)
    return free / (sum(v.load.num_running for v in views) - len(within) + len(views))
