"""Dispatch policies rank candidates; ties break by instance id."""

from __future__ import annotations

import pytest

from services.manager.domain import DispatchAsk
from services.manager.policies import POLICY_NAMES, PrefixPolicy, make_policy
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


@pytest.mark.parametrize("name", ["load", "balanced"])
def test_load_and_balanced_send_a_request_where_a_batch_slot_is_free_first(name):
    """A request sent to a full batch waits in its queue while another instance would start it now."""
    full = make_candidate("a", num_free_blocks=1000, num_free_slots=0)  # freest, but its batch is full
    free = make_candidate("b", num_free_blocks=300, num_running=1, num_free_slots=1)
    assert choose(name, full, free) == "b"
    unknown = make_candidate("c", num_free_blocks=200, num_running=1)  # an older instance: counts as having one
    assert choose(name, full, unknown) == "c"
    assert choose(name, free, unknown) == "b"  # then by freeness
    also_full = make_candidate("d", num_free_blocks=300, num_running=1, num_free_slots=0)
    assert choose(name, also_full, full) == "a"  # every batch full: by freeness, as before


def test_queue_and_prefix_affinity_do_not_look_at_slots():
    """`queue` ranks by queue lengths already; `prefix` keeps a holder within its slack (its fallback is `load`)."""
    assert choose("queue", make_candidate("a", num_free_slots=0), make_candidate("b", num_running=1)) == "a"
    policy = PrefixPolicy()
    policy.choose([make_candidate("a")], prefix_ask(1, 2))
    full_holder = make_candidate("a", num_running=2, num_free_slots=0)
    assert policy.choose([full_holder, make_candidate("b", num_free_slots=4)], prefix_ask(1, 2)).instance_id == "a"
    assert policy.choose([full_holder, make_candidate("b", num_free_slots=4)], prefix_ask(7)).instance_id == "b"


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
    with pytest.raises(ValueError, match="load, queue, balanced, round_robin, prefix, flood"):
        make_policy("fastest")


# prefix: affinity to where the prompt's leading chunks were sent, within a load slack

def prefix_ask(*keys: int) -> DispatchAsk:
    return DispatchAsk(request_id=f"r-{keys}", num_prompt_tokens=16 * len(keys), prefix_chunk_keys=keys)


def test_prefix_follows_the_instance_that_got_the_same_prefix():
    policy = PrefixPolicy()
    a, b_freest = make_candidate("a", num_free_blocks=500), make_candidate("b", num_free_blocks=900)
    assert policy.choose([a, b_freest], prefix_ask(1, 2, 3)).instance_id == "b"  # by load, then remembered
    a_freest, b = make_candidate("a", num_free_blocks=900), make_candidate("b", num_free_blocks=500)
    assert policy.choose([a_freest, b], prefix_ask(1, 2, 3)).instance_id == "b"  # affinity beats freeness
    assert policy.choose([a_freest, b], prefix_ask(7, 8)).instance_id == "a"  # another prefix: by load


def test_prefix_prefers_the_longest_leading_match():
    policy = PrefixPolicy()
    a, b = make_candidate("a"), make_candidate("b")
    policy.choose([a], prefix_ask(1, 2, 3, 4))  # a holds 1 2 3 4
    policy.choose([b], prefix_ask(1, 2, 9))  # b holds 1 2 9
    assert policy.choose([a, b], prefix_ask(1, 2, 3, 5)).instance_id == "a"  # 3 chunks against 2
    assert policy.choose([a, b], prefix_ask(1, 2, 9, 5)).instance_id == "b"
    assert policy.choose([a, b], prefix_ask(6, 2, 3, 4)).instance_id == "a"  # no leading match: by load (id)
    policy.choose([b], prefix_ask(6, 2, 3, 4))
    assert policy.choose([a, b], prefix_ask(6, 2, 3, 4)).instance_id == "a"  # both hold all 4: tie, like load


@pytest.mark.parametrize(("num_running", "num_waiting", "expected"), [
    (4, 0, "holder"),  # queue 4 = shortest 0 + slack 4: still affinity
    (1, 3, "holder"),
    (5, 0, "idle"),  # one past the slack: by load
    (0, 5, "idle"),
])
def test_prefix_load_slack_bounds_affinity(num_running, num_waiting, expected):
    policy = PrefixPolicy(load_slack=4)
    policy.choose([make_candidate("holder")], prefix_ask(1, 2))
    holder = make_candidate("holder", num_free_blocks=500, num_running=num_running, num_waiting=num_waiting)
    idle = make_candidate("idle", num_free_blocks=1000)  # freer in every case: load would take it
    assert policy.choose([holder, idle], prefix_ask(1, 2)).instance_id == expected


def test_prefix_slack_zero_takes_the_holder_only_on_an_equal_queue():
    policy = PrefixPolicy(load_slack=0)
    policy.choose([make_candidate("b")], prefix_ask(1))
    assert policy.choose([make_candidate("a"), make_candidate("b")], prefix_ask(1)).instance_id == "b"
    assert policy.choose([make_candidate("a"), make_candidate("b", num_running=1)], prefix_ask(1)).instance_id == "a"
    with pytest.raises(ValueError, match="load_slack must be >= 0"):
        PrefixPolicy(load_slack=-1)


@pytest.mark.parametrize("keys", [(), (1, 2), (5,)])
def test_prefix_without_keys_or_matches_chooses_like_load(keys):
    policy, load = PrefixPolicy(), make_policy("load")
    policy.choose([make_candidate("z")], prefix_ask(5, 6))  # z holds 5 6 but is not a candidate below
    candidates = [make_candidate("a", num_free_blocks=100),
                  make_candidate("b", num_free_blocks=1000, num_running=8),  # freest (111), queue over the slack
                  make_candidate("c", num_free_blocks=100, num_waiting=1)]
    ask = prefix_ask(*keys)
    assert policy.choose(candidates, ask).instance_id == load.choose(candidates, ask).instance_id == "b"


def test_prefix_forgets_the_least_recent_keys_past_its_bound():
    policy = PrefixPolicy(max_keys=2)
    policy.choose([make_candidate("b")], prefix_ask(1))
    a, b = make_candidate("a"), make_candidate("b")
    assert policy.choose([a, b], prefix_ask(1)).instance_id == "b"
    policy.choose([a], prefix_ask(2, 3))  # two newer keys push key 1 out
    assert policy.choose([a, b], prefix_ask(1)).instance_id == "a"  # forgotten: by load (id)


def test_prefix_ignores_holders_that_are_not_candidates():
    policy = PrefixPolicy()
    policy.choose([make_candidate("gone")], prefix_ask(1, 2))
    policy.choose([make_candidate("c")], prefix_ask(1))
    a, c = make_candidate("a", num_free_blocks=900), make_candidate("c", num_free_blocks=100)
    assert policy.choose([a, c], prefix_ask(1, 2)).instance_id == "c"  # c holds 1; gone (holds 1 2) left
    assert policy.choose([a], prefix_ask(1, 2)).instance_id == "a"


def test_make_policy_passes_the_prefix_load_slack():
    policy = make_policy("prefix", prefix_load_slack=0)
    policy.choose([make_candidate("b")], prefix_ask(1))
    assert policy.choose([make_candidate("a"), make_candidate("b", num_waiting=1)], prefix_ask(1)).instance_id == "a"
