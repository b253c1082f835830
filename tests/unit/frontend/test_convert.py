"""Frontend proto conversion: what a DispatchRequest carries."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.prefix_hash import MAX_PREFIX_CHUNKS, prefix_chunk_keys
from services.common.gen.ferry.v1 import instance_pb2
from services.frontend.convert import chunk_from_proto, dispatch_request_to_proto, generate_request_to_proto
from services.frontend.generation import GenerateSpec, InstanceId, RequestId, Sampling

pytestmark = pytest.mark.timeout(10)
PROMPT = tuple(range(3, 3 + 40))  # two full 16-token chunks and a partial one


def spec() -> GenerateSpec:
    return GenerateSpec(RequestId("cmpl-1"), PROMPT, Sampling(temperature=0.0, max_tokens=8), priority=1,
                        prefix_chunk_keys=tuple(prefix_chunk_keys(PROMPT, MAX_PREFIX_CHUNKS)))


def test_dispatch_request_carries_the_prompts_chunk_keys():
    msg = dispatch_request_to_proto(spec(), [InstanceId("i-9")])
    assert (msg.request_id, msg.num_prompt_tokens, msg.max_tokens, msg.priority) == ("cmpl-1", 40, 8, 1)
    assert list(msg.exclude_instance_ids) == ["i-9"]
    assert list(msg.prefix_chunk_keys) == prefix_chunk_keys(PROMPT, MAX_PREFIX_CHUNKS)
    assert len(msg.prefix_chunk_keys) == 2


def test_a_cache_salt_reaches_the_instance_and_salts_the_dispatch_keys():
    salted = replace(spec(), sampling=Sampling(temperature=0.0, max_tokens=8, cache_salt="tenant-a"))
    assert generate_request_to_proto(salted).sampling.cache_salt == "tenant-a"
    salted_keys = prefix_chunk_keys(PROMPT, MAX_PREFIX_CHUNKS, "tenant-a")
    assert len(salted_keys) == 2 and not set(salted_keys) & set(spec().prefix_chunk_keys)


def test_a_resumed_dispatch_keeps_the_prompts_keys():
    resumed = replace(spec(), resume_token_ids=tuple(range(100, 120)))
    msg = dispatch_request_to_proto(resumed, [])
    assert msg.num_prompt_tokens == 60 and list(msg.prefix_chunk_keys) == list(spec().prefix_chunk_keys)


def test_stop_token_ids_reach_the_instance():
    stopping = replace(spec(), sampling=Sampling(temperature=0.0, max_tokens=8, stop_token_ids=(7, 9)))
    assert list(generate_request_to_proto(stopping).sampling.stop_token_ids) == [7, 9]


def test_where_the_prompt_was_first_computed_from_goes_out_with_a_resume_and_comes_back_on_chunks():
    resumed = replace(spec(), resume_token_ids=(100, 101), resume_first_start=32)
    assert generate_request_to_proto(resumed).resume_first_start == 32
    assert not generate_request_to_proto(spec()).HasField("resume_first_start")
    assert chunk_from_proto(instance_pb2.GenerateChunk(token_index=0, first_start=16)).first_start == 16
    assert chunk_from_proto(instance_pb2.GenerateChunk(token_index=0)).first_start is None
