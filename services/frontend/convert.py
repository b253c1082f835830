"""proto ↔ domain for the frontend (with the client modules, the only frontend code that
touches generated code)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2
from services.frontend.generation import (CopyRef, FinishReason, GenerateSpec, Handoff, InstanceId, RequestId, Sampling,
                                          Target, TokenChunk, TokenLogprob)

_FINISH_REASON_FROM_PROTO = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def sampling_to_proto(sampling: Sampling) -> common_pb2.SamplingParams:
    if sampling.max_tokens is None:
        raise ValueError("sampling.max_tokens must be resolved (resolve_max_tokens) before sending")
    msg = common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.num_logprobs, presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, logit_bias=dict(sampling.logit_bias),
        repetition_penalty=sampling.repetition_penalty, min_p=sampling.min_p, cache_salt=sampling.cache_salt,
        min_tokens=sampling.min_tokens, grammar=sampling.grammar)
    if sampling.seed is not None:
        msg.seed = sampling.seed
    if sampling.num_prompt_logprobs is not None:
        msg.prompt_logprobs = sampling.num_prompt_logprobs
    return msg


def generate_request_to_proto(spec: GenerateSpec, can_prefill_on_decode: bool = False) -> instance_pb2.GenerateRequest:
    return instance_pb2.GenerateRequest(
        request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
        sampling=sampling_to_proto(spec.sampling), priority=spec.priority,
        resume_token_ids=list(spec.resume_token_ids), can_prefill_on_decode=can_prefill_on_decode,
        resume_text=spec.resume_text if spec.resume_token_ids else None,
        resume_first_start=spec.resume_first_start, attempt=spec.attempt)


def chunk_from_proto(msg: instance_pb2.GenerateChunk) -> TokenChunk:
    return TokenChunk(
        token_index=msg.token_index, token_ids=tuple(msg.token_ids), text=msg.text,
        finish_reason=_FINISH_REASON_FROM_PROTO.get(msg.finish_reason), epoch=msg.epoch,
        logprobs=tuple(map(_logprob_from_proto, msg.logprobs)) if msg.logprobs else (),  # (most chunks: none)
        num_prompt_tokens=msg.num_prompt_tokens,
        prompt_logprobs=tuple(map(_logprob_from_proto, msg.prompt_logprobs)) if msg.prompt_logprobs else (),
        handoff=_handoff_from_proto(msg.handoff) if msg.HasField("handoff") else None,
        first_start=msg.first_start if msg.HasField("first_start") else None)


def abort_request_to_proto(request_id: RequestId, copy: CopyRef | None) -> instance_pb2.AbortRequest:
    if copy is None:
        return instance_pb2.AbortRequest(request_id=request_id)
    return instance_pb2.AbortRequest(request_id=request_id, attempt=copy.attempt, epoch=copy.epoch)


def attach_request_to_proto(request_id: RequestId, from_token_index: int, epoch: int) -> instance_pb2.AttachRequest:
    return instance_pb2.AttachRequest(request_id=request_id, from_token_index=from_token_index, epoch=epoch)


def _handoff_from_proto(msg: instance_pb2.Handoff) -> Handoff:
    return Handoff(dst_instance_id=InstanceId(msg.dst_instance_id), dst_address=msg.dst_address, epoch=msg.epoch,
                   next_token_index=msg.next_token_index)


def dispatch_request_to_proto(spec: GenerateSpec, exclude: Sequence[InstanceId]) -> manager_pb2.DispatchRequest:
    return manager_pb2.DispatchRequest(
        request_id=spec.request_id,
        num_prompt_tokens=len(spec.prompt_token_ids) + len(spec.resume_token_ids),
        max_tokens=(spec.sampling.max_tokens or 0) - len(spec.resume_token_ids),
        priority=spec.priority, exclude_instance_ids=list(exclude), prefix_chunk_keys=list(spec.prefix_chunk_keys))


def target_from_proto(msg: manager_pb2.DispatchResponse) -> Target | None:
    if not msg.instance_id or not msg.address:
        return None
    return Target(InstanceId(msg.instance_id), msg.address, can_prefill_on_decode=msg.can_prefill_on_decode)


def _logprob_from_proto(msg: instance_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob,
                        top=tuple(zip(msg.top_token_ids, msg.top_logprobs, strict=False)), rank=msg.rank or 1)
