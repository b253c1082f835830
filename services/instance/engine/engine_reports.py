"""What an engine reports about itself: its load (`LoadSnapshot`, the instance's load report) and its
requests (`RequestSnapshot`, ListRequests)."""

from __future__ import annotations

from dataclasses import dataclass

from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.migration_state import is_prefill_done
from services.instance.engine.request import Request, RequestId, RequestOrigin, RequestStatus
from services.instance.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_blocks_needed_by_waiting: int
    freeness: float  # (free - needed by waiting - headroom) / (running + 1)
    decoding_ids: frozenset[str] = frozenset()  # running requests past their prefill: PD hand-off candidates
    num_headroom_blocks: int = 0  # kept free for high-priority requests (--priority-headroom-blocks each)
    # Taken in since start, counted in this snapshot's figures: added (Generate), imported (a migration in).
    num_requests_admitted: int = 0
    num_requests_migrated_in: int = 0
    num_free_slots: int = 0  # batch slots no running, suspended, reserved or waiting request will take

    @property
    def num_decoding(self) -> int:
        return len(self.decoding_ids)


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    request_id: RequestId
    status: RequestStatus
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int  # resumed tokens included
    num_computed_tokens: int
    num_blocks: int  # KV blocks it holds (none of those given back out of its sliding window)
    origin: RequestOrigin = RequestOrigin.DISPATCHED
    migrated_from: str = ""  # with MIGRATED_IN: the migration's source instance
    migration_id: str = ""  # MIGRATED_IN: the migration that brought it; RESUMED: the one whose copy it replaced

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def state(self) -> str:
        return self.status.value


def load_snapshot(scheduler: Scheduler, config: EngineConfig, num_reserved: int, num_requests_admitted: int,
                  num_requests_migrated_in: int) -> LoadSnapshot:
    """The engine's load now; `num_reserved`: migrations in holding blocks and a batch slot (reservations.py)."""
    num_running, num_free = len(scheduler.running), scheduler.block_manager.num_free_blocks
    num_needed = scheduler.num_blocks_needed_by_waiting()
    num_headroom = config.priority_headroom_blocks * sum(
        r.priority > 0 for r in (*scheduler.running, *scheduler.waiting))
    return LoadSnapshot(
        num_running=num_running, num_waiting=len(scheduler.waiting), num_free_blocks=num_free,
        num_total_blocks=scheduler.block_manager.num_blocks, num_blocks_needed_by_waiting=num_needed,
        freeness=(num_free - num_needed - num_headroom) / (num_running + 1),
        decoding_ids=frozenset(r.request_id for r in scheduler.running if is_prefill_done(r)),
        num_headroom_blocks=num_headroom, num_requests_admitted=num_requests_admitted,
        num_requests_migrated_in=num_requests_migrated_in,
        num_free_slots=max(config.max_num_seqs - scheduler.num_busy_slots - num_reserved - len(scheduler.waiting), 0),
    )  # fmt: skip


def request_snapshot(request: Request) -> RequestSnapshot:
    r = request
    return RequestSnapshot(
        request_id=r.request_id, status=r.status, priority=r.priority,
        num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
        num_computed_tokens=r.num_computed_tokens, num_blocks=len(r.block_table) - r.num_dropped_blocks, origin=r.origin,
        migrated_from=r.migrated_from, migration_id=r.migration_id,
    )  # fmt: skip
