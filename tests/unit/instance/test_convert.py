"""The instance's proto edges: sampling parameters and a migrating request's state survive the wire whole
(a migrated or handed-off request samples on the destination exactly as it did on the source)."""

import dataclasses

import llguidance

from services.instance.convert import (
    load_to_proto,
    request_info_to_proto,
    request_state_from_proto,
    request_state_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from services.instance.engine.engine_reports import LoadSnapshot, RequestSnapshot
from services.instance.engine.migration_state import RequestState
from services.instance.engine.request import RequestId, RequestOrigin, RequestStatus, SamplingParams


def test_every_sampling_field_survives_the_round_trip():
    sampling = SamplingParams(
        temperature=0.5, top_p=0.75, top_k=7, seed=2**64 - 1, max_tokens=33, stop=("x", "yz"), stop_token_ids=(4, 9),
        ignore_eos=True, logprobs=3, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias=((2, -1.5), (8, 3.0)),
        repetition_penalty=1.25, min_p=0.125, cache_salt="tenant", prompt_logprobs=2, min_tokens=4,
        grammar=llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    assert all(getattr(sampling, f.name) != f.default for f in dataclasses.fields(SamplingParams))
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling


def test_a_request_state_survives_the_round_trip_and_an_old_source_sends_no_first_start():
    state = RequestState(request_id=RequestId("r"), prompt_token_ids=(5, 6, 7), output_token_ids=(8,),
                         sampling=SamplingParams(seed=3), seed=3, priority=1, epoch=2, num_computed_tokens=3,
                         text_sent="x", num_resumed_tokens=1, first_start=0, max_num_tokens=40)
    assert all(getattr(state, f.name) != f.default for f in dataclasses.fields(RequestState))
    assert request_state_from_proto(request_state_to_proto(state)) == state
    old = request_state_to_proto(state)
    old.ClearField("first_start")  # a source from before first_start travelled
    assert request_state_from_proto(old) == dataclasses.replace(state, first_start=None)


def test_the_load_report_carries_the_requests_taken_in():
    load = LoadSnapshot(num_running=2, num_waiting=1, num_free_blocks=10, num_total_blocks=16,
                        num_blocks_needed_by_waiting=3, freeness=2.0, num_requests_admitted=9,
                        num_requests_migrated_in=4)
    report = load_to_proto("i-1", load, num_requests_served=6, timestamp=1.0)
    assert (report.num_requests_admitted, report.num_requests_migrated_in) == (9, 4)
    assert report.HasField("num_free_slots") and report.num_free_slots == 0  # none free is said, not left unset


def test_a_request_info_names_the_migration_that_brought_the_request():
    """The manager matches an unanswered migration by its id (RequestInfo.migration_id), not by its source alone."""
    snapshot = RequestSnapshot(RequestId("r"), RequestStatus.RUNNING, 0, 4, 2, 5, 1, RequestOrigin.MIGRATED_IN,
                               migrated_from="a", migration_id="a-0123")
    info = request_info_to_proto(snapshot, "b")
    assert (info.migrated_from_instance_id, info.migration_id) == ("a", "a-0123")
