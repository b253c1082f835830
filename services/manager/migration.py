"""Domain objects of live migration as the manager sees it: settings, orders, records.

The manager decides *which instances* exchange a request and when; the source instance
picks the request (unless told) and runs the protocol (README "Live migration").
Nothing here knows about gRPC; `convert.py` maps these to and from protos.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted
from services.manager.domain import InstanceId

DEFAULT_PAIRING = "load"
REFUSED_STATUS = "RESOURCE_EXHAUSTED"  # a migration that ended with it was refused for want of room, no fault


class SourceBusy(ResourceExhausted):
    """MigrateOut refused at once by its source: its own migration slots are busy (its PD hand-offs, say). Nothing
    was tried, so it is no failed migration (not in the history, no backoff of the pair); a destination's refusal,
    which the source passes on with the same status, is one."""


class TransferBusy(ResourceExhausted):
    """MigrateOut failed because a transfer service on the way (the source's or the destination's) had no free
    staging slot for the copy (its source says so: x-ferry-refused-by: transfer). The destination had room, so it is
    no refusal: recorded `failed` (reason RESOURCE_EXHAUSTED, the only failure with that reason), a capacity to raise
    (--num-staging-slots), and it backs its pair off like any failure."""


class MigrationSelection(enum.Enum):
    """How a source picks the request to hand over when the manager names none."""

    # least KV to copy (the default): the oldest queued request while the source's batch is full, else fewest tokens
    SHORTEST_RUNNING = "shortest_running"
    LONGEST_RUNNING = "longest_running"  # most tokens: frees the most blocks
    LAST_COME_FIRST = "last_come_first"  # the newest arrival
    PREFILL_DONE = "prefill_done"  # only requests with their first token, oldest first (the PD hand-off)


class MigrationTrigger(enum.Enum):
    LOAD = "load"  # the migration loop balancing freeness
    DRAIN = "drain"  # the source is draining
    ADMIN = "admin"  # AdminService.Migrate
    PD = "pd"  # a prefilled request leaving a prefill instance for a decode instance


class MigrationOutcome(enum.Enum):
    COMMITTED = "committed"  # the destination owns the request
    FAILED = "failed"  # aborted before commit by a fault: the request still runs on the source
    # Not taken for want of room (RESOURCE_EXHAUSTED): the destination had no free KV blocks, batch slot or
    # migration slot since the load report it was picked on; the request still runs on the source. No fault: under
    # KV pressure a load report a tick old makes these. (A transfer service whose staging slots stayed busy is a
    # failure: TransferBusy.)
    REFUSED = "refused"
    UNKNOWN = "unknown"  # the source gave no answer and the instances did not tell (migration_settle.py)

    @classmethod
    def not_committed(cls, reason: str, is_transfer_busy: bool = False) -> MigrationOutcome:
        """The outcome of a migration that was not committed, by the gRPC status name it ended with (a
        RESOURCE_EXHAUSTED of a transfer service, `is_transfer_busy`, is a failure: the destination had room)."""
        return cls.REFUSED if reason == REFUSED_STATUS and not is_transfer_busy else cls.FAILED


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """The migration part of the cluster policy (stored with dispatch in etcd config/policy)."""

    is_enabled: bool = False  # the load-balancing loop; drains migrate regardless
    threshold: float = 1.0  # freeness gap (blocks per running request) a pair must exceed
    selection: MigrationSelection = MigrationSelection.SHORTEST_RUNNING
    pairing: str = DEFAULT_PAIRING


@dataclass(frozen=True, slots=True)
class MigrationOrder:
    """One migration to run: from `src` to `dst`, the given request or one the source picks."""

    src_instance_id: InstanceId
    src_address: str
    dst_instance_id: InstanceId
    dst_address: str
    trigger: MigrationTrigger
    selection: MigrationSelection = MigrationSelection.SHORTEST_RUNNING
    request_id: str = ""  # empty: the source picks by `selection`
    backend: str = ""  # transfer backend (grpc, gloo, nccl, shm); empty: the source's default
    exclude_request_ids: frozenset[str] = field(default_factory=frozenset)  # just migrated: not again yet
    max_stages: int | None = None  # live stages; None = the source's default, 0 = one stop-and-copy (PD)
    can_decode_on_prefill: bool = False  # the destination is a PREFILL instance chosen on purpose (a drain's last resort)
    dst_max_model_len: int = 0  # the destination's max_model_len (its record; 0: not known): the source picks what fits


@dataclass(frozen=True, slots=True)
class MigrationFigures:
    """What the source reports about a committed migration (MigrateOutResponse)."""

    request_id: str
    num_blocks: int = 0
    num_bytes: int = 0
    num_stages: int = 0
    backend: str = ""
    duration_ms: float = 0.0
    downtime_ms: float = 0.0
    num_cached_at_destination: int = 0  # leading blocks the destination had cached with the same bits: not sent
    migration_id: str = ""  # the source's id of it, where it gave no answer but announced it with its pick


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One migration attempt, as kept in the leader's history and shown by ListMigrations."""

    order: MigrationOrder
    outcome: MigrationOutcome
    figures: MigrationFigures  # zeros (and the ordered request id, if any) when it failed
    started_at: float  # unix seconds
    reason: str = ""  # failed, refused, unknown: the gRPC status name of MigrateOut (refused: RESOURCE_EXHAUSTED)
    message: str = ""  # failed, refused, unknown: the status details; committed: a note (the source gave no answer, yet it moved)

    @property
    def is_committed(self) -> bool:
        return self.outcome is MigrationOutcome.COMMITTED

    def involves(self, instance_id: str) -> bool:
        return instance_id in (self.order.src_instance_id, self.order.dst_instance_id)
