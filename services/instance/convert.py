"""proto ↔ domain for the instance service (the only instance module, with
server.py and client code, that touches generated code)."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, transfer_pb2
from services.instance.config import InstanceRole
from services.instance.engine.engine_reports import LoadSnapshot, RequestSnapshot
from services.instance.engine.step_output import StepOutput
from services.instance.engine.logprobs import TokenLogprob
from services.instance.engine.migration_state import MigrationSelection, RequestState
from services.instance.engine.prefix_cache import NO_PREFIX_CACHE_STATS, PrefixCacheStats
from services.instance.engine.request import RequestId, RequestOrigin, SamplingParams
from services.instance.handoff import Handoff
from services.instance.migration_domain import MigrateOutPlan, MigrationResult, Reservation
from services.transfer.convert import backend_from_proto, backend_to_proto

_MAX_REQUEST_ID_LEN = 256


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        repetition_penalty=msg.repetition_penalty or 1.0,
        min_p=msg.min_p,
        cache_salt=msg.cache_salt,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        min_tokens=msg.min_tokens,
        grammar=msg.grammar,
    )


def sampling_to_proto(sampling: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        max_tokens=sampling.max_tokens, stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs, presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, logit_bias=dict(sampling.logit_bias),
        repetition_penalty=sampling.repetition_penalty, min_p=sampling.min_p, cache_salt=sampling.cache_salt,
        prompt_logprobs=sampling.prompt_logprobs, min_tokens=sampling.min_tokens,
        grammar=sampling.grammar)


def check_request_id(request_id: str) -> str:
    if not request_id:
        raise InvalidArgument("request_id: must not be empty")
    if len(request_id) > _MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id: longer than {_MAX_REQUEST_ID_LEN} characters")
    return request_id


def chunk_to_proto(output: StepOutput, epoch: int) -> instance_pb2.GenerateChunk:
    chunk = instance_pb2.GenerateChunk(
        request_id=output.request_id,
        token_index=output.token_index,
        token_ids=output.new_token_ids,
        text=output.text,
        finish_reason=_finish_reason_to_proto(output.finish_reason),
        epoch=epoch,
        num_prompt_tokens=output.num_prompt_tokens,
    )
    chunk.logprobs.extend(map(_logprob_to_proto, output.logprobs or ()))
    chunk.prompt_logprobs.extend(map(_logprob_to_proto, output.prompt_logprobs or ()))
    if output.first_start is not None:
        chunk.first_start = output.first_start
    return chunk


def _logprob_to_proto(entry: TokenLogprob) -> instance_pb2.TokenLogprob:
    return instance_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                                     top_token_ids=list(entry.top_token_ids), top_logprobs=list(entry.top_logprobs))


def handoff_chunk_to_proto(request_id: str, handoff: Handoff, epoch: int) -> instance_pb2.GenerateChunk:
    """The last chunk of a migrated request on its old owner (`epoch`): no tokens, no finish reason."""
    return instance_pb2.GenerateChunk(
        request_id=request_id, token_index=handoff.next_token_index, epoch=epoch,
        handoff=instance_pb2.Handoff(dst_instance_id=handoff.dst_instance_id, dst_address=handoff.dst_address,
                                     epoch=handoff.epoch, next_token_index=handoff.next_token_index))


# Live migration.

_SELECTION_FROM_PROTO = {
    instance_pb2.MIGRATION_SELECTION_UNSPECIFIED: MigrationSelection.SHORTEST_RUNNING,
    instance_pb2.MIGRATION_SELECTION_SHORTEST_RUNNING: MigrationSelection.SHORTEST_RUNNING,
    instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING: MigrationSelection.LONGEST_RUNNING,
    instance_pb2.MIGRATION_SELECTION_LAST_COME_FIRST: MigrationSelection.LAST_COME_FIRST,
    instance_pb2.MIGRATION_SELECTION_PREFILL_DONE: MigrationSelection.PREFILL_DONE,
}


def migrate_out_plan_from_proto(msg: instance_pb2.MigrateOutRequest) -> MigrateOutPlan:
    if not msg.dst_instance_id or not msg.dst_address:
        raise InvalidArgument("dst_instance_id and dst_address: both required (the destination instance's id "
                              "and gRPC address)")
    if msg.request_id:
        check_request_id(msg.request_id)
    if msg.HasField("max_stages") and msg.max_stages < 0:
        raise InvalidArgument(f"max_stages: must be >= 0 (0 = one stop-and-copy stage), got {msg.max_stages}")
    if msg.dst_max_model_len < 0:
        raise InvalidArgument(f"dst_max_model_len: must be >= 0 (0 = not known), got {msg.dst_max_model_len}")
    if msg.selection not in _SELECTION_FROM_PROTO:
        raise InvalidArgument(f"selection: {msg.selection} is not a MigrationSelection value")
    backend = None if msg.backend == transfer_pb2.TRANSFER_BACKEND_UNSPECIFIED else backend_from_proto(msg.backend)
    return MigrateOutPlan(
        request_id=msg.request_id, dst_instance_id=msg.dst_instance_id, dst_address=msg.dst_address,
        dst_transfer_address=msg.dst_transfer_address, backend=backend, selection=_SELECTION_FROM_PROTO[msg.selection],
        exclude_request_ids=frozenset(msg.exclude_request_ids),
        max_stages=msg.max_stages if msg.HasField("max_stages") else None,
        can_decode_on_prefill=msg.can_decode_on_prefill, dst_max_model_len=msg.dst_max_model_len)


def migration_result_to_proto(result: MigrationResult) -> instance_pb2.MigrateOutResponse:
    return instance_pb2.MigrateOutResponse(
        request_id=result.request_id, src_instance_id=result.src_instance_id, dst_instance_id=result.dst_instance_id,
        num_blocks=result.num_blocks, num_bytes=result.num_bytes, num_stages=result.num_stages,
        backend=backend_to_proto(result.backend), duration_ms=result.duration_ms, downtime_ms=result.downtime_ms,
        num_cached_at_destination=result.num_cached_at_destination)


def reservation_to_proto(reservation: Reservation) -> instance_pb2.PrepareMigrateInResponse:
    return instance_pb2.PrepareMigrateInResponse(block_ids=list(reservation.block_ids),
                                                 dst_transfer_address=reservation.transfer_address,
                                                 dst_transfer_id=reservation.transfer_id,
                                                 num_cached_blocks=reservation.num_cached_blocks,
                                                 write_grant=reservation.write_grant,
                                                 cached_block_checksums=list(reservation.cached_checksums),
                                                 num_leading_blocks_not_held=reservation.num_not_held)


def reservation_from_proto(msg: instance_pb2.PrepareMigrateInResponse) -> Reservation:
    return Reservation(tuple(msg.block_ids), msg.dst_transfer_address, msg.dst_transfer_id, msg.num_cached_blocks,
                       msg.write_grant, tuple(msg.cached_block_checksums), msg.num_leading_blocks_not_held)


def request_state_to_proto(state: RequestState) -> instance_pb2.RequestState:
    return instance_pb2.RequestState(
        request_id=state.request_id, prompt_token_ids=list(state.prompt_token_ids),
        output_token_ids=list(state.output_token_ids), sampling=sampling_to_proto(state.sampling), seed=state.seed,
        priority=state.priority, epoch=state.epoch, num_computed_tokens=state.num_computed_tokens,
        text_sent=state.text_sent, num_resumed_tokens=state.num_resumed_tokens, first_start=state.first_start,
        max_num_tokens=state.max_num_tokens)


def request_state_from_proto(msg: instance_pb2.RequestState) -> RequestState:
    if not msg.HasField("sampling"):
        raise InvalidArgument("state.sampling: required")
    return RequestState(
        request_id=RequestId(check_request_id(msg.request_id)), prompt_token_ids=tuple(msg.prompt_token_ids),
        output_token_ids=tuple(msg.output_token_ids), sampling=sampling_from_proto(msg.sampling), seed=msg.seed,
        priority=msg.priority, epoch=msg.epoch, num_computed_tokens=msg.num_computed_tokens,
        text_sent=msg.text_sent, num_resumed_tokens=msg.num_resumed_tokens,
        first_start=msg.first_start if msg.HasField("first_start") else None, max_num_tokens=msg.max_num_tokens)


def load_to_proto(instance_id: str, load: LoadSnapshot, num_requests_served: int, timestamp: float,
                  step_time_ms_p50: float = 0.0, num_steps: int = 0, num_prefilled: int = 0,
                  prefix_cache: PrefixCacheStats = NO_PREFIX_CACHE_STATS,
                  num_incoming_migrations: int = 0, num_suspended: int = 0,
                  num_free_migration_out_slots: int | None = None,
                  step_time_ms_token_weighted_p50: float = 0.0, num_preemptions: int = 0) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        instance_id=instance_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        num_blocks_needed_by_waiting=load.num_blocks_needed_by_waiting,
        freeness=load.freeness,
        num_headroom_blocks=load.num_headroom_blocks,
        num_requests_served=num_requests_served,
        timestamp=timestamp,
        step_time_ms_p50=step_time_ms_p50,
        step_time_ms_token_weighted_p50=step_time_ms_token_weighted_p50,
        num_steps=num_steps,
        num_prefilled=num_prefilled,
        prefix_cache_queried_tokens=prefix_cache.num_queried_tokens,
        prefix_cache_hit_tokens=prefix_cache.num_hit_tokens,
        num_incoming_migrations=num_incoming_migrations,
        num_requests_admitted=load.num_requests_admitted,
        num_requests_migrated_in=load.num_requests_migrated_in,
        num_free_slots=load.num_free_slots,
        num_suspended=num_suspended,
        num_free_migration_out_slots=num_free_migration_out_slots,
        num_preemptions=num_preemptions,
    )


_ROLE_TO_PROTO = {
    InstanceRole.BOTH: common_pb2.ROLE_BOTH,
    InstanceRole.PREFILL: common_pb2.ROLE_PREFILL,
    InstanceRole.DECODE: common_pb2.ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


_ORIGIN_TO_PROTO = {
    RequestOrigin.DISPATCHED: instance_pb2.REQUEST_ORIGIN_DISPATCHED,
    RequestOrigin.RESUMED: instance_pb2.REQUEST_ORIGIN_RESUMED,
    RequestOrigin.MIGRATED_IN: instance_pb2.REQUEST_ORIGIN_MIGRATED_IN,
}


def request_info_to_proto(info: RequestSnapshot, instance_id: str) -> instance_pb2.RequestInfo:
    return instance_pb2.RequestInfo(
        request_id=info.request_id, instance_id=instance_id, num_tokens=info.num_tokens, state=info.state,
        num_output_tokens=info.num_output_tokens, origin=_ORIGIN_TO_PROTO[info.origin],
        migrated_from_instance_id=info.migrated_from, migration_id=info.migration_id)


def role_to_proto(role: InstanceRole) -> int:
    return _ROLE_TO_PROTO[role]


def role_from_proto(role: int) -> InstanceRole:
    if role not in _ROLE_FROM_PROTO:
        raise InvalidArgument(f"role: must be ROLE_BOTH, ROLE_PREFILL or ROLE_DECODE, got {role}")
    return _ROLE_FROM_PROTO[role]


def _finish_reason_to_proto(reason: object) -> int:
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}")
