"""Proto <-> domain for the manager. The only manager module besides server/client that touches *_pb2."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, manager_pb2
from services.manager.cluster_view import ClusterTotals
from services.manager.domain import DispatchAsk, InstanceId, InstanceState, InstanceView, Load, Placement, Role

_ROLE_TO_PROTO = {Role.BOTH: common_pb2.ROLE_BOTH, Role.PREFILL: common_pb2.ROLE_PREFILL,
                  Role.DECODE: common_pb2.ROLE_DECODE}
_STATE_TO_PROTO = {InstanceState.SERVING: common_pb2.INSTANCE_STATE_SERVING,
                   InstanceState.DRAINING: common_pb2.INSTANCE_STATE_DRAINING,
                   InstanceState.UNHEALTHY: common_pb2.INSTANCE_STATE_UNHEALTHY}


def dispatch_ask_from_proto(request: manager_pb2.DispatchRequest) -> DispatchAsk:
    if request.num_prompt_tokens < 0:
        raise InvalidArgument(f"num_prompt_tokens must be >= 0, got {request.num_prompt_tokens}")
    return DispatchAsk(request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                       max_tokens=request.max_tokens, priority=request.priority,
                       exclude_instance_ids=frozenset(InstanceId(i) for i in request.exclude_instance_ids))


def placement_to_proto(placement: Placement) -> manager_pb2.DispatchResponse:
    return manager_pb2.DispatchResponse(instance_id=placement.instance_id, address=placement.address,
                                        policy=placement.policy)


def load_from_proto(report: common_pb2.LoadReport) -> Load:
    return Load(num_running=report.num_running, num_waiting=report.num_waiting,
                num_free_blocks=report.num_free_blocks, num_total_blocks=report.num_total_blocks,
                num_blocks_needed_by_waiting=report.num_blocks_needed_by_waiting,
                num_requests_served=report.num_requests_served)


def state_to_proto(state: InstanceState) -> int:
    return _STATE_TO_PROTO[state]


def instance_to_proto(view: InstanceView) -> manager_pb2.InstanceInfo:
    record, load = view.record, view.load
    return manager_pb2.InstanceInfo(
        instance_id=record.instance_id, address=record.address, role=_ROLE_TO_PROTO[record.role],
        state=_STATE_TO_PROTO[view.state], pid=record.pid, host=record.host, model=record.model,
        num_running=load.num_running, num_waiting=load.num_waiting, num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks, freeness=load.freeness, num_requests_served=load.num_requests_served,
        num_dispatched=view.num_dispatched, report_age_s=-1.0 if view.report_age_s is None else view.report_age_s)


def cluster_status_to_proto(totals: ClusterTotals, *, leader_id: str, leader_address: str, policy: str,
                            answered_by: str) -> manager_pb2.GetClusterStatusResponse:
    return manager_pb2.GetClusterStatusResponse(
        leader_id=leader_id, leader_address=leader_address, num_instances=totals.num_instances,
        num_serving=totals.num_serving, num_draining=totals.num_draining, num_unhealthy=totals.num_unhealthy,
        num_running=totals.num_running, num_waiting=totals.num_waiting, average_freeness=totals.average_freeness,
        dispatch_policy=policy, num_dispatched=totals.num_dispatched, answered_by=answered_by)
