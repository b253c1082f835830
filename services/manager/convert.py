"""Proto <-> domain for the manager. The only manager module besides server/client that touches *_pb2."""

from __future__ import annotations

import math
from typing import Any

import grpc

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2, transfer_pb2
from services.common.pick_announcement import REFUSED_BY_TRANSFER
from services.common.prefix_hash import MAX_PREFIX_CHUNKS
from services.manager.cluster_view import ClusterTotals
from services.manager.scaling import ScalingSettings
from services.manager.domain import DispatchAsk, InstanceId, InstanceState, InstanceView, Load, Placement, Role
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationSelection, MigrationSettings, MigrationTrigger)
from services.manager.migration_settle import HeldRequest, RequestOrigin

_ROLE_TO_PROTO = {Role.BOTH: common_pb2.ROLE_BOTH, Role.PREFILL: common_pb2.ROLE_PREFILL,
                  Role.DECODE: common_pb2.ROLE_DECODE}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}
_STATE_TO_PROTO = {InstanceState.SERVING: common_pb2.INSTANCE_STATE_SERVING,
                   InstanceState.DRAINING: common_pb2.INSTANCE_STATE_DRAINING,
                   InstanceState.UNHEALTHY: common_pb2.INSTANCE_STATE_UNHEALTHY}
_SELECTION_TO_PROTO = {
    MigrationSelection.SHORTEST_RUNNING: instance_pb2.MIGRATION_SELECTION_SHORTEST_RUNNING,
    MigrationSelection.LONGEST_RUNNING: instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING,
    MigrationSelection.LAST_COME_FIRST: instance_pb2.MIGRATION_SELECTION_LAST_COME_FIRST,
    MigrationSelection.PREFILL_DONE: instance_pb2.MIGRATION_SELECTION_PREFILL_DONE,
}
_SELECTION_FROM_PROTO = {v: k for k, v in _SELECTION_TO_PROTO.items()}
_BACKEND_PREFIX = "TRANSFER_BACKEND_"


def dispatch_ask_from_proto(request: manager_pb2.DispatchRequest) -> DispatchAsk:
    if not request.request_id:
        raise InvalidArgument("request_id: required (the id the request will run under on its instance)")
    if request.num_prompt_tokens < 0:
        raise InvalidArgument(f"num_prompt_tokens must be >= 0, got {request.num_prompt_tokens}")
    if request.max_tokens < 0:
        raise InvalidArgument(f"max_tokens must be >= 0 (0 = unknown), got {request.max_tokens}")
    if len(request.prefix_chunk_keys) > MAX_PREFIX_CHUNKS:
        raise InvalidArgument(f"prefix_chunk_keys: at most {MAX_PREFIX_CHUNKS} keys (the prompt's first chunks), "
                              f"got {len(request.prefix_chunk_keys)}")
    return DispatchAsk(request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                       max_tokens=request.max_tokens, priority=request.priority,
                       exclude_instance_ids=frozenset(InstanceId(i) for i in request.exclude_instance_ids),
                       prefix_chunk_keys=tuple(request.prefix_chunk_keys))


def placement_to_proto(placement: Placement) -> manager_pb2.DispatchResponse:
    return manager_pb2.DispatchResponse(instance_id=placement.instance_id, address=placement.address,
                                        policy=placement.policy, can_prefill_on_decode=placement.can_prefill_on_decode)


def role_from_proto(role: int) -> Role:
    if role not in _ROLE_FROM_PROTO:
        raise InvalidArgument(f"role: must be ROLE_BOTH, ROLE_PREFILL or ROLE_DECODE, got {role}")
    return _ROLE_FROM_PROTO[role]


def role_to_proto(role: Role) -> int:
    return _ROLE_TO_PROTO[role]


_LOAD_COUNTS = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_blocks_needed_by_waiting",
                "num_requests_served", "num_prefilled", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                "num_headroom_blocks", "num_incoming_migrations", "num_requests_admitted", "num_requests_migrated_in",
                "num_free_slots", "num_suspended", "num_free_migration_out_slots", "num_preemptions")


def load_from_proto(report: common_pb2.LoadReport) -> Load:
    for name in _LOAD_COUNTS:
        if getattr(report, name) < 0:
            raise InvalidArgument(f"LoadReport.{name}: must be >= 0, got {getattr(report, name)}")
    return Load(num_running=report.num_running, num_waiting=report.num_waiting,
                num_free_blocks=report.num_free_blocks, num_total_blocks=report.num_total_blocks,
                num_blocks_needed_by_waiting=report.num_blocks_needed_by_waiting,
                num_requests_served=report.num_requests_served, num_prefilled=report.num_prefilled,
                num_prefix_queried_tokens=report.prefix_cache_queried_tokens,
                num_prefix_hit_tokens=report.prefix_cache_hit_tokens, num_headroom_blocks=report.num_headroom_blocks,
                num_incoming_migrations=report.num_incoming_migrations,
                num_requests_admitted=report.num_requests_admitted,
                num_requests_migrated_in=report.num_requests_migrated_in,
                num_free_slots=report.num_free_slots if report.HasField("num_free_slots") else None,
                num_suspended=report.num_suspended,
                num_free_migration_out_slots=report.num_free_migration_out_slots
                if report.HasField("num_free_migration_out_slots") else None,
                num_preemptions=report.num_preemptions)


def state_to_proto(state: InstanceState) -> int:
    return _STATE_TO_PROTO[state]


def instance_to_proto(view: InstanceView) -> manager_pb2.InstanceInfo:
    record, load = view.record, view.load
    return manager_pb2.InstanceInfo(
        instance_id=record.instance_id, address=record.address, role=_ROLE_TO_PROTO[record.role],
        state=_STATE_TO_PROTO[view.state], pid=record.pid, host=record.host, model=record.model,
        num_running=load.num_running, num_waiting=load.num_waiting, num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks, freeness=load.freeness, num_requests_served=load.num_requests_served,
        num_dispatched=view.num_dispatched, report_age_s=-1.0 if view.report_age_s is None else view.report_age_s,
        is_drained=view.is_drained, prefix_cache_queried_tokens=load.num_prefix_queried_tokens,
        prefix_cache_hit_tokens=load.num_prefix_hit_tokens, num_free_slots=load.num_free_slots,
        max_num_seqs=record.max_num_seqs, num_preemptions=load.num_preemptions,
        model_fingerprint=record.model_fingerprint)


def cluster_status_to_proto(totals: ClusterTotals, *, leader_id: str, leader_address: str, policy: str,
                            answered_by: str, migrate_time_s: float) -> manager_pb2.GetClusterStatusResponse:
    return manager_pb2.GetClusterStatusResponse(
        leader_id=leader_id, leader_address=leader_address, num_instances=totals.num_instances,
        num_serving=totals.num_serving, num_draining=totals.num_draining, num_unhealthy=totals.num_unhealthy,
        num_running=totals.num_running, num_waiting=totals.num_waiting, average_freeness=totals.average_freeness,
        dispatch_policy=policy, num_dispatched=totals.num_dispatched, answered_by=answered_by,
        migrate_time_s=migrate_time_s)


# migration


def policy_to_proto(dispatch: str, migration: MigrationSettings, scaling: ScalingSettings) -> manager_pb2.Policy:
    return manager_pb2.Policy(dispatch=dispatch, migration_enabled=migration.is_enabled,
                              migration_threshold=migration.threshold,
                              migration_selection=_SELECTION_TO_PROTO[migration.selection],
                              migration_pairing=migration.pairing, scaling_enabled=scaling.is_enabled,
                              scaling_low_freeness=scaling.low_freeness, scaling_high_freeness=scaling.high_freeness,
                              scaling_min_instances=scaling.min_instances, scaling_max_instances=scaling.max_instances)


def scaling_settings_from_proto(policy: manager_pb2.Policy, current: ScalingSettings) -> ScalingSettings:
    """`current` with what `policy` sets; InvalidArgument (naming the field) for values that make no sense."""
    def pick(name: str, value):
        return getattr(policy, f"scaling_{name}") if policy.HasField(f"scaling_{name}") else value
    settings = ScalingSettings(is_enabled=pick("enabled", current.is_enabled),
                               low_freeness=pick("low_freeness", current.low_freeness),
                               high_freeness=pick("high_freeness", current.high_freeness),
                               min_instances=pick("min_instances", current.min_instances),
                               max_instances=pick("max_instances", current.max_instances))
    settings.check()
    return settings


def migration_settings_from_proto(policy: manager_pb2.Policy, current: MigrationSettings) -> MigrationSettings:
    """`current` with what `policy` sets (unset fields keep their value); InvalidArgument for bad values."""
    threshold = policy.migration_threshold if policy.HasField("migration_threshold") else current.threshold
    if not threshold >= 0 or math.isinf(threshold):  # NaN fails the first test
        raise InvalidArgument(f"migration_threshold must be a finite number >= 0 (a freeness gap), got {threshold}")
    if policy.migration_selection and policy.migration_selection not in _SELECTION_FROM_PROTO:
        raise InvalidArgument(f"migration_selection: {policy.migration_selection} is not a MigrationSelection value")
    selection = _SELECTION_FROM_PROTO.get(policy.migration_selection, current.selection)
    return MigrationSettings(
        is_enabled=policy.migration_enabled if policy.HasField("migration_enabled") else current.is_enabled,
        threshold=threshold, selection=selection, pairing=policy.migration_pairing or current.pairing)


def migrate_out_request_to_proto(order: MigrationOrder) -> instance_pb2.MigrateOutRequest:
    return instance_pb2.MigrateOutRequest(
        request_id=order.request_id, dst_instance_id=order.dst_instance_id, dst_address=order.dst_address,
        backend=backend_to_proto(order.backend), selection=_SELECTION_TO_PROTO[order.selection],
        exclude_request_ids=sorted(order.exclude_request_ids), max_stages=order.max_stages,
        can_decode_on_prefill=order.can_decode_on_prefill, dst_max_model_len=order.dst_max_model_len)


def backend_to_proto(name: str) -> int:
    """'' (the source's default), grpc, gloo, nccl or shm; InvalidArgument otherwise."""
    if not name:
        return transfer_pb2.TRANSFER_BACKEND_UNSPECIFIED
    try:
        return transfer_pb2.TransferBackend.Value(_BACKEND_PREFIX + name.upper())
    except ValueError:
        raise InvalidArgument(f"unknown transfer backend {name!r}; one of grpc, gloo, nccl, shm") from None


def migration_figures_from_proto(reply: instance_pb2.MigrateOutResponse) -> MigrationFigures:
    backend = transfer_pb2.TransferBackend.Name(reply.backend).removeprefix(_BACKEND_PREFIX).lower()
    return MigrationFigures(request_id=reply.request_id, num_blocks=reply.num_blocks, num_bytes=reply.num_bytes,
                            num_stages=reply.num_stages, backend="" if backend == "unspecified" else backend,
                            duration_ms=reply.duration_ms, downtime_ms=reply.downtime_ms,
                            num_cached_at_destination=reply.num_cached_at_destination)


_ORIGIN_FROM_PROTO = {instance_pb2.REQUEST_ORIGIN_DISPATCHED: RequestOrigin.DISPATCHED,
                      instance_pb2.REQUEST_ORIGIN_RESUMED: RequestOrigin.RESUMED,
                      instance_pb2.REQUEST_ORIGIN_MIGRATED_IN: RequestOrigin.MIGRATED_IN}


def held_request_from_proto(info: instance_pb2.RequestInfo) -> HeldRequest:
    return HeldRequest(_ORIGIN_FROM_PROTO.get(info.origin, RequestOrigin.UNKNOWN), info.migrated_from_instance_id,
                       info.migration_id)


def migrate_response_to_proto(record: MigrationRecord) -> manager_pb2.MigrateResponse:
    return manager_pb2.MigrateResponse(**_migration_fields(record))


def migration_record_to_proto(record: MigrationRecord) -> manager_pb2.MigrationRecord:
    return manager_pb2.MigrationRecord(**_migration_fields(record), outcome=record.outcome.value, reason=record.reason,
                                       message=record.message, trigger=record.order.trigger.value,
                                       started_at=record.started_at, migration_id=record.figures.migration_id)


def journaled_migration_from_proto(msg: manager_pb2.MigrationRecord, src_address: str,
                                   dst_address: str) -> MigrationRecord:
    """A record as the journal stored it (ValueError if it names no known outcome or trigger); the instances'
    addresses are not stored: today's are given."""
    order = MigrationOrder(InstanceId(msg.src_instance_id), src_address, InstanceId(msg.dst_instance_id), dst_address,
                           MigrationTrigger(msg.trigger), request_id=msg.request_id)
    return MigrationRecord(order, MigrationOutcome(msg.outcome), _record_figures(msg), msg.started_at,
                           reason=msg.reason, message=msg.message)


def _record_figures(msg: manager_pb2.MigrationRecord) -> MigrationFigures:
    return MigrationFigures(request_id=msg.request_id, num_blocks=msg.num_blocks, num_bytes=msg.num_bytes,
                            num_stages=msg.num_stages, backend=msg.backend, duration_ms=msg.duration_ms,
                            downtime_ms=msg.downtime_ms, num_cached_at_destination=msg.num_cached_at_destination,
                            migration_id=msg.migration_id)


def _migration_fields(record: MigrationRecord) -> dict[str, Any]:
    """The fields MigrateResponse and MigrationRecord share: what moved where, and its figures."""
    order, figures = record.order, record.figures
    return dict(request_id=figures.request_id, src_instance_id=order.src_instance_id,
                dst_instance_id=order.dst_instance_id, num_blocks=figures.num_blocks, num_bytes=figures.num_bytes,
                num_stages=figures.num_stages, backend=figures.backend, duration_ms=figures.duration_ms,
                downtime_ms=figures.downtime_ms, num_cached_at_destination=figures.num_cached_at_destination)


def _check_reported_figures(msg: manager_pb2.MigrationRecord) -> None:
    for name in ("num_blocks", "num_bytes", "num_stages", "num_cached_at_destination"):
        if getattr(msg, name) < 0:
            raise InvalidArgument(f"{name}: must be >= 0, got {getattr(msg, name)}")
    for name in ("duration_ms", "downtime_ms", "started_at"):
        value = getattr(msg, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{name}: must be a finite number >= 0, got {value}")


_STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
_REPORTED_OUTCOMES = tuple(o.value for o in (MigrationOutcome.COMMITTED, MigrationOutcome.FAILED,
                                             MigrationOutcome.REFUSED))


def reported_migration_from_proto(msg: manager_pb2.MigrationRecord, src_address: str,
                                  dst_address: str) -> MigrationRecord:
    """A PD hand-off an instance ran on its own (ReportMigration): committed, or failed with a reason (refused where
    that is RESOURCE_EXHAUSTED: the decode instance had no room)."""
    if not msg.request_id or not msg.src_instance_id or not msg.dst_instance_id:
        raise InvalidArgument("request_id, src_instance_id and dst_instance_id: all required")
    if msg.outcome not in ("", *_REPORTED_OUTCOMES):
        raise InvalidArgument(f"outcome: expected committed, failed or refused, got {msg.outcome[:40]!r}")
    _check_reported_figures(msg)
    order = MigrationOrder(InstanceId(msg.src_instance_id), src_address, InstanceId(msg.dst_instance_id), dst_address,
                           MigrationTrigger.PD, MigrationSelection.PREFILL_DONE, request_id=msg.request_id,
                           max_stages=0)
    figures = _record_figures(msg)
    if msg.outcome in ("", MigrationOutcome.COMMITTED.value):
        return MigrationRecord(order, MigrationOutcome.COMMITTED, figures, msg.started_at)
    reason = msg.reason if msg.reason in _STATUS_NAMES else "UNKNOWN"  # a metrics label: a closed set
    outcome = MigrationOutcome.not_committed(reason, is_transfer_busy=msg.refused_by == REFUSED_BY_TRANSFER)
    return MigrationRecord(order, outcome, figures, msg.started_at, reason=reason, message=msg.message[:1024])
