"""proto ↔ domain for the instance service (the only instance module, with
server.py and client code, that touches generated code)."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from services.instance.engine.engine import LoadSnapshot, StepOutput
from services.instance.engine.request import SamplingParams

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
    )


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
    for entry in output.logprobs or ():
        chunk.logprobs.append(instance_pb2.TokenLogprob(
            token_id=entry.token_id, logprob=entry.logprob,
            top_token_ids=list(entry.top_token_ids), top_logprobs=list(entry.top_logprobs)))
    return chunk


def load_to_proto(instance_id: str, load: LoadSnapshot, num_requests_served: int, timestamp: float,
                  step_time_ms_p50: float = 0.0, num_steps: int = 0) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        instance_id=instance_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        num_blocks_needed_by_waiting=load.num_blocks_needed_by_waiting,
        freeness=load.freeness,
        num_requests_served=num_requests_served,
        timestamp=timestamp,
        step_time_ms_p50=step_time_ms_p50,
        num_steps=num_steps,
    )


def _finish_reason_to_proto(reason: object) -> int:
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}")
