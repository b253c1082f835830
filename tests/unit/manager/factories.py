"""Small factories for manager unit tests (no sockets)."""

from __future__ import annotations

from services.manager.cluster_view import ClusterView
from services.manager.domain import Candidate, InstanceId, InstanceRecord, Load, Role


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_record(instance_id: str, role: Role = Role.BOTH, num_blocks: int = 1000, block_size: int = 16,
                is_draining: bool = False) -> InstanceRecord:
    return InstanceRecord(InstanceId(instance_id), f"127.0.0.1:{7000 + hash(instance_id) % 1000}", role=role,
                          model="tiny", pid=42, host="h1", block_size=block_size, num_blocks=num_blocks,
                          is_draining=is_draining)


def make_load(num_free_blocks: int = 1000, num_running: int = 0, num_waiting: int = 0,
              num_blocks_needed_by_waiting: int = 0, num_total_blocks: int = 1000,
              num_requests_admitted: int = 0, num_requests_migrated_in: int = 0,
              num_free_slots: int | None = None, num_free_migration_out_slots: int | None = None,
              num_incoming_migrations: int = 0) -> Load:
    return Load(num_running=num_running, num_waiting=num_waiting, num_free_blocks=num_free_blocks,
                num_total_blocks=num_total_blocks, num_blocks_needed_by_waiting=num_blocks_needed_by_waiting,
                num_requests_admitted=num_requests_admitted, num_requests_migrated_in=num_requests_migrated_in,
                num_free_slots=num_free_slots, num_free_migration_out_slots=num_free_migration_out_slots,
                num_incoming_migrations=num_incoming_migrations)


def make_candidate(instance_id: str, **load) -> Candidate:
    return Candidate.of(InstanceId(instance_id), f"addr-{instance_id}", make_load(**load))


def make_view(*instance_ids: str, clock: FakeClock | None = None, report_timeout_s: float = 3.0,
              **load) -> ClusterView:
    """A view whose members all reported `load` just now."""
    view = ClusterView(report_timeout_s=report_timeout_s, clock=clock or FakeClock())
    for instance_id in instance_ids:
        view.put_member(make_record(instance_id))
        view.apply_report(InstanceId(instance_id), make_load(**load))
    return view
