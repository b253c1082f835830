"""The instance's proto edges: sampling parameters survive the wire whole (a migrated or handed-off
request samples on the destination exactly as it did on the source)."""

import dataclasses

import llguidance

from services.instance.convert import sampling_from_proto, sampling_to_proto
from services.instance.engine.request import SamplingParams


def test_every_sampling_field_survives_the_round_trip():
    sampling = SamplingParams(
        temperature=0.5, top_p=0.75, top_k=7, seed=2**64 - 1, max_tokens=33, stop=("x", "yz"), stop_token_ids=(4, 9),
        ignore_eos=True, logprobs=3, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias=((2, -1.5), (8, 3.0)),
        repetition_penalty=1.25, min_p=0.125, cache_salt="tenant", prompt_logprobs=2, min_tokens=4,
        grammar=llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    assert all(getattr(sampling, f.name) != f.default for f in dataclasses.fields(SamplingParams))
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling
