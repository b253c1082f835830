"""What ferryctl shows: plain records built from the admin API's replies (see client.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class InstanceRow:
    instance_id: str
    address: str
    role: str  # both | prefill | decode
    state: str  # serving | draining | unhealthy
    model: str
    host: str
    pid: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    freeness: float
    num_requests_served: int
    num_dispatched: int
    report_age_s: float  # -1 = no load report yet
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_free_slots: int | None = None  # batch slots free; None: the instance reported none (not known)
    max_num_seqs: int = 0  # its batch slots; 0: not known (an older instance)
    is_drained: bool = False  # draining, and nothing runs, waits or is suspended there any more
    num_preemptions: int = 0  # running requests sent back to its queue to free KV blocks since it started
    model_fingerprint: str = ""  # a hash of its weights: two fine-tunes of one base differ here; "": not known

    @property
    def shown_state(self) -> str:
        """The STATE column: `drained` for a draining instance that is empty (safe to stop)."""
        return "drained" if self.is_drained else self.state

    @property
    def has_report(self) -> bool:
        """False while the manager that answered has no load report of it (a leader elected or restarted
        moments ago, or a standby answering alone): its load fields are then zeros, not its load."""
        return self.report_age_s >= 0

    @property
    def slots(self) -> str:
        """Free batch slots over all of them: `3/8`, `?` for what is not known."""
        free = "?" if self.num_free_slots is None else str(self.num_free_slots)
        return f"{free}/{self.max_num_seqs or '?'}"

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted context tokens the prefix cache served, since the instance started."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0

    @property
    def kv_used_fraction(self) -> float:
        if self.num_total_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True, slots=True)
class InstanceListing:
    """ListInstances: the instances, and whose view they are."""

    rows: tuple[InstanceRow, ...]
    leader_id: str  # empty: no manager leads
    answered_by: str  # the manager whose view this is; empty from an older manager, which does not say

    @property
    def is_leaders_view(self) -> bool:
        """Answered by the leader (or by an older manager, which does not say). Else no load reports reach the
        manager that answered (no manager leads, or a standby answered alone: the leader did not in time), and
        it shows the instances unhealthy, though they may well serve."""
        return not self.answered_by or self.answered_by == self.leader_id


@dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
    instance_id: str
    state: str  # waiting | running | finished
    num_tokens: int  # prompt + generated
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class RequestList:
    requests: tuple[RequestRow, ...]
    unreachable_instance_ids: tuple[str, ...]  # instances that did not answer in time


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    leader_id: str
    leader_address: str
    answered_by: str  # the manager whose view this is
    dispatch_policy: str
    num_instances: int
    num_serving: int
    num_draining: int
    num_unhealthy: int
    num_running: int
    num_waiting: int
    num_dispatched: int
    average_freeness: float

    @property
    def is_leaders_view(self) -> bool:
        """As `InstanceListing.is_leaders_view`: answered by the leader (or by an older manager, which does not say)."""
        return not self.answered_by or self.answered_by == self.leader_id


@dataclass(frozen=True, slots=True)
class DrainResult:
    instance_id: str
    state: str
    is_drained: bool  # nothing runs, waits or is suspended there any more
    num_remaining: int  # running + waiting requests still on it (the leader migrates them off)


@dataclass(frozen=True, slots=True)
class MigrateResult:
    request_id: str
    src_instance_id: str
    dst_instance_id: str
    num_blocks: int
    num_bytes: int
    num_stages: int
    backend: str
    duration_ms: float
    downtime_ms: float
    num_cached_at_destination: int = 0  # blocks the destination had cached with the same bits: not sent


@dataclass(frozen=True, slots=True)
class MigrationRow:
    """One entry of the leader's migration history."""

    started_at: float  # unix seconds
    request_id: str
    src_instance_id: str
    dst_instance_id: str
    trigger: str  # load | drain | admin | pd
    outcome: str  # committed | failed | refused | unknown
    num_blocks: int
    num_bytes: int
    num_stages: int
    backend: str
    duration_ms: float
    downtime_ms: float
    reason: str  # failed, refused, unknown: the status code
    message: str  # failed, refused, unknown: the details
    num_cached_at_destination: int = 0  # blocks the destination had cached with the same bits: not sent


def to_json(record: Any) -> Any:
    """A JSON-ready view of a record, a list of records, or a plain value."""
    if isinstance(record, (list, tuple)):
        return [to_json(item) for item in record]
    if hasattr(record, "__dataclass_fields__"):
        return {key: to_json(value) for key, value in asdict(record).items()}
    return record
