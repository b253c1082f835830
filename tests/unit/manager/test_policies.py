"""Dispatch policies rank candidates; ties break by instance id."""

from __future__ import annotations

import pytest

from services.manager.domain import DispatchAsk
from services.manager.policies import POLICY_NAMES, make_policy
from tests.unit.manager.factories import make_candidate

pytestmark = pytest.mark.timeout(10)
ASK = DispatchAsk(request_id="r-1", num_prompt_tokens=32)


def choose(policy_name: str, *candidates):
    return make_policy(policy_name).choose(list(candidates), ASK).instance_id


def test_load_picks_highest_freeness():
    assert choose("load", make_candidate("a", num_free_blocks=100),
                  make_candidate("b", num_free_blocks=900, num_running=2),  # 300
                  make_candidate("c", num_free_blocks=500)) == "c"


def test_load_counts_blocks_needed_by_waiting():
    assert choose("load", make_candidate("a", num_free_blocks=500, num_blocks_needed_by_waiting=400),
                  make_candidate("b", num_free_blocks=200)) == "b"


def test_queue_prefers_fewest_waiting_then_fewest_running():
    assert choose("queue", make_candidate("a", num_waiting=1, num_running=0),
                  make_candidate("b", num_waiting=0, num_running=5),
                  make_candidate("c", num_waiting=0, num_running=3)) == "c"


def test_balanced_penalizes_a_queue_that_load_ignores():
    full_batch = make_candidate("a", num_free_blocks=1000, num_running=1, num_waiting=4)  # freeness 500
    small = make_candidate("b", num_free_blocks=300, num_running=1)  # freeness 150
    assert choose("load", full_batch, small) == "a"
    assert choose("balanced", full_batch, small) == "b"


def test_round_robin_cycles_by_id_and_survives_membership_changes():
    policy = make_policy("round_robin")
    a, b, c = make_candidate("a"), make_candidate("b"), make_candidate("c")
    picks = [policy.choose([a, b, c], ASK).instance_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    assert policy.choose([a, c], ASK).instance_id == "c"  # b left: continue after a
    assert policy.choose([a, b], ASK).instance_id == "a"  # wraps


def test_flood_always_takes_the_first_by_id():
    assert choose("flood", make_candidate("a", num_free_blocks=0, num_running=50), make_candidate("b")) == "a"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ties_break_by_instance_id(name):
    # candidates arrive sorted by id (the view guarantees it); equal loads -> the smallest id
    assert choose(name, make_candidate("i-1"), make_candidate("i-2"), make_candidate("i-3")) == "i-1"


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="load, queue, balanced, round_robin, flood"):
        make_policy("fastest")
