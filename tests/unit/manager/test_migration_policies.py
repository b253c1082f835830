"""Migration pairing without sockets: ranking, threshold, hysteresis, drains."""

from __future__ import annotations

import dataclasses

import pytest

from services.manager.domain import InstanceId, Role
from services.manager.migration import MigrationTrigger
from services.manager.migration_policies import (LoadPairing, Peer, make_pairing, pair_drains, pair_prefilled,
                                                 stays_freer_after_move)
from tests.unit.manager.factories import make_load

pytestmark = pytest.mark.timeout(10)


def peer(instance_id: str, num_running: int = 0, num_free_blocks: int = 1000, role: Role = Role.BOTH,
         is_draining: bool = False, **load) -> Peer:
    loaded = make_load(num_free_blocks=num_free_blocks, num_running=num_running, **load)
    return Peer(InstanceId(instance_id), f"addr-{instance_id}", role, loaded, loaded.freeness, is_draining)


def pairs_of(pairs) -> list[tuple[str, str]]:
    return [(p.src.instance_id, p.dst.instance_id) for p in pairs]


def test_the_most_loaded_pairs_with_the_freest_then_inwards():
    peers = [peer("a", num_running=20, num_free_blocks=800), peer("b", num_running=10, num_free_blocks=900),
             peer("c"), peer("d", num_running=1, num_free_blocks=990)]
    assert pairs_of(LoadPairing().pair(peers, threshold=1.0)) == [("a", "c"), ("b", "d")]


def test_a_gap_under_the_threshold_moves_nothing():
    peers = [peer("a", num_running=4, num_free_blocks=960), peer("b", num_running=1, num_free_blocks=990)]
    gap = peers[1].freeness - peers[0].freeness  # 495 - 192 = 303
    assert pairs_of(LoadPairing().pair(peers, threshold=gap + 0.1)) == []
    assert pairs_of(LoadPairing().pair(peers, threshold=gap - 0.1)) == [("a", "b")]


def test_hysteresis_a_move_that_would_swap_the_pair_is_not_made():
    # one request on a, none on b: moving it only moves the imbalance (a would become the freer)
    lone = [peer("a", num_running=1, num_free_blocks=990), peer("b")]
    assert pairs_of(LoadPairing().pair(lone, threshold=0.0)) == []
    # 3 against 2 of equal size: after a move b holds 3 and a 2, b less free than a -> no move
    near = [peer("a", num_running=3, num_free_blocks=970), peer("b", num_running=2, num_free_blocks=980)]
    assert pairs_of(LoadPairing().pair(near, threshold=0.0)) == []
    # 4 against 2: after a move 3 and 3, level -> move (and level pairs never move again)
    far = [peer("a", num_running=4, num_free_blocks=960), peer("b", num_running=2, num_free_blocks=980)]
    assert pairs_of(LoadPairing().pair(far, threshold=0.0)) == [("a", "b")]
    level = [peer("a", num_running=3, num_free_blocks=970), peer("b", num_running=3, num_free_blocks=970)]
    assert pairs_of(LoadPairing().pair(level, threshold=0.0)) == []


def test_equal_loads_never_ping_pong():
    peers = [peer(i, num_running=3, num_free_blocks=970) for i in "abcd"]
    assert LoadPairing().pair(peers, threshold=0.0) == []


def test_queued_requests_make_a_source_and_the_destination_must_have_room():
    queued = peer("a", num_running=0, num_free_blocks=0, num_waiting=3, num_blocks_needed_by_waiting=30,
                  num_total_blocks=100)
    roomy = peer("b", num_free_blocks=100, num_total_blocks=100)
    assert pairs_of(LoadPairing().pair([queued, roomy], threshold=0.0)) == [("a", "b")]
    assert not stays_freer_after_move(queued.load, make_load(num_free_blocks=5, num_total_blocks=100))


def test_prefill_only_and_full_instances_are_no_destinations():
    peers = [peer("a", num_running=20, num_free_blocks=800), peer("p", role=Role.PREFILL),
             peer("f", num_free_blocks=0), peer("d", num_running=2, num_free_blocks=980, role=Role.DECODE)]
    assert pairs_of(LoadPairing().pair(peers, threshold=0.0)) == [("a", "d")]


def test_ties_break_by_instance_id():
    peers = [peer("z", num_running=5, num_free_blocks=950), peer("y", num_running=5, num_free_blocks=950),
             peer("c"), peer("b")]
    assert pairs_of(LoadPairing().pair(peers, threshold=0.0)) == [("y", "b"), ("z", "c")]


def test_equally_free_destinations_take_turns():
    """Idle instances that tie: the one that received a migration least recently goes first, so a
    flood spreads over all of them even when each empties again before the next tick."""
    def idle(instance_id: str, last_received_at: float) -> Peer:
        return dataclasses.replace(peer(instance_id), last_received_at=last_received_at)

    source = peer("a", num_running=20, num_free_blocks=800)
    peers = [source, idle("b", 3.0), idle("c", 1.0), idle("d", 2.0)]
    assert pairs_of(LoadPairing().pair(peers, threshold=0.0)) == [("a", "c")]
    peers = [source, idle("b", 3.0), idle("c", 4.0), idle("d", 2.0)]
    assert pairs_of(LoadPairing().pair(peers, threshold=0.0)) == [("a", "d")]
    assert pairs_of(pair_drains([dataclasses.replace(source, is_draining=True)], peers[1:])) == [("a", "d")]


def test_drains_take_the_freest_destinations_one_each():
    draining = [peer("x", num_running=2, num_free_blocks=980, is_draining=True),
                peer("w", num_waiting=1, is_draining=True), peer("empty", is_draining=True)]
    serving = [peer("a", num_running=5, num_free_blocks=950), peer("b"), peer("p", role=Role.PREFILL)]
    pairs = pair_drains(draining, serving)
    assert pairs_of(pairs) == [("w", "b"), ("x", "a")]
    assert {p.trigger for p in pairs} == {MigrationTrigger.DRAIN}


def test_draining_the_last_decode_instance_moves_its_requests_to_prefill_instances():
    draining = [peer("d", num_running=3, num_free_blocks=970, role=Role.DECODE, is_draining=True)]
    prefill = [peer("p1", num_running=1, num_free_blocks=990, role=Role.PREFILL), peer("p0", role=Role.PREFILL)]
    assert pairs_of(pair_drains(draining, prefill)) == [("d", "p0")]
    decode = peer("d2", num_running=2, num_free_blocks=980, role=Role.DECODE)
    assert pairs_of(pair_drains(draining, [*prefill, decode])) == [("d", "d2")]  # a decode instance first


def test_a_gap_made_by_priority_headroom_moves_a_request():
    """The freeness gap comes from the source's headroom: the move check must count it too."""
    headroom = dataclasses.replace(make_load(num_free_blocks=600, num_running=4), num_headroom_blocks=400)
    src = Peer(InstanceId("a"), "addr-a", Role.BOTH, headroom, headroom.freeness, False)
    dst = peer("b", num_running=3, num_free_blocks=700)
    assert stays_freer_after_move(src.load, dst.load)
    assert pairs_of(LoadPairing().pair([src, dst], 1.0)) == [("a", "b")]


def test_an_unknown_pairing_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown migration pairing 'x'; one of: load"):
        make_pairing("x")


def test_a_destination_that_cannot_take_a_request_leaves_the_next_one_to_try():
    # The freest instance is small and cannot hold an average request of the source; before, the
    # source gave up there instead of pairing with the next destination (found by review).
    loaded = peer("a", num_running=20, num_free_blocks=100)  # freeness 4.8, ~45 blocks per request
    small = peer("small", num_free_blocks=40, num_total_blocks=40)  # freeness 40
    big = peer("big", num_running=10, num_free_blocks=300)  # freeness 27.3
    assert pairs_of(LoadPairing().pair([loaded, small, big], threshold=1.0)) == [("a", "big")]


def test_a_destination_without_a_free_batch_slot_leaves_the_next_one_to_try():
    # Many free blocks but every batch slot taken (--max-num-seqs): the destination refuses the move
    # (RESOURCE_EXHAUSTED) and the pair backs off. Before, the freest by blocks was picked anyway, and a
    # third of policy_sim's load moves under bursts (--max-num-seqs 4) failed so.
    loaded = peer("a", num_running=4, num_free_blocks=100, num_waiting=3, num_blocks_needed_by_waiting=30,
                  num_free_slots=0)
    full = peer("full", num_running=4, num_free_blocks=900, num_free_slots=0)  # freeness 180
    roomy = peer("roomy", num_running=3, num_free_blocks=600, num_free_slots=1)  # freeness 150
    assert pairs_of(LoadPairing().pair([loaded, full, roomy], threshold=1.0)) == [("a", "roomy")]
    assert pairs_of(pair_drains([dataclasses.replace(loaded, is_draining=True)], [full, roomy])) == [("a", "roomy")]
    unknown = peer("old", num_running=4, num_free_blocks=900)  # an older instance reports no slots: not ruled out
    assert pairs_of(LoadPairing().pair([loaded, unknown], threshold=1.0)) == [("a", "old")]


def test_an_instance_serving_shorter_sequences_is_the_last_destination_tried():
    # Found by an outside-in run: a third instance joined with --max-model-len 256 (and the most free blocks)
    # while requests that may reach ~350 tokens ran; the first was stopped (SIGTERM). Its drain kept pairing
    # it with the short one, which refused each request (longer than it serves), so within the 5 s grace
    # only one of three requests moved to the instance that serves 1024 tokens; the others were cut and resumed.
    draining = dataclasses.replace(peer("a", num_running=3, num_free_blocks=970, is_draining=True), max_model_len=1024)
    short = dataclasses.replace(peer("short", num_free_blocks=8000, num_total_blocks=8000), max_model_len=256)
    long = dataclasses.replace(peer("long", num_running=3, num_free_blocks=980), max_model_len=1024)
    unknown = peer("old", num_running=3, num_free_blocks=960)  # no max_model_len in its record: not ruled out
    assert pairs_of(pair_drains([draining], [short, long])) == [("a", "long")]
    assert pairs_of(pair_drains([draining], [short, unknown])) == [("a", "old")]
    assert pairs_of(pair_drains([draining], [short])) == [("a", "short")]  # the only one: its requests may fit
    loaded = dataclasses.replace(peer("a", num_running=30, num_free_blocks=700), max_model_len=1024)
    assert pairs_of(LoadPairing().pair([loaded, short, long], threshold=1.0)) == [("a", "long")]
    as_long = dataclasses.replace(short, max_model_len=1024)
    assert pairs_of(LoadPairing().pair([loaded, as_long, long], threshold=1.0)) == [("a", "short")]  # freest


def test_a_destination_whose_migration_slots_are_busy_leaves_the_next_one_to_try():
    # Its own migrations (its PD hand-offs, a migration out) hold its --max-concurrent-migrations, one pool for
    # migrations in and out: its PrepareMigrateIn is refused RESOURCE_EXHAUSTED. Before, it was picked anyway: the
    # migration failed and the pair backed off while a destination with a free slot waited.
    loaded = peer("a", num_running=4, num_free_blocks=100)
    busy = peer("busy", num_running=1, num_free_blocks=900, num_free_migration_out_slots=0)  # the freest
    free = peer("free", num_running=2, num_free_blocks=800, num_free_migration_out_slots=1)
    assert pairs_of(LoadPairing().pair([loaded, busy, free], threshold=1.0)) == [("a", "free")]
    assert pairs_of(pair_drains([dataclasses.replace(loaded, is_draining=True)], [busy, free])) == [("a", "free")]
    old = peer("old", num_running=1, num_free_blocks=900)  # an older instance reports no slots: not ruled out
    assert pairs_of(LoadPairing().pair([loaded, old, free], threshold=1.0)) == [("a", "old")]
    decode = dataclasses.replace(busy, role=Role.DECODE)
    prefill = peer("p", num_running=1, num_free_blocks=990, role=Role.PREFILL)
    prefill = dataclasses.replace(prefill, load=dataclasses.replace(prefill.load, num_prefilled=1))
    assert pairs_of(pair_prefilled([prefill, decode])) == []
    assert pairs_of(pair_prefilled([prefill, dataclasses.replace(free, role=Role.DECODE)])) == [("p", "free")]


def test_a_drains_last_resort_prefers_a_destination_with_a_free_batch_slot():
    """No serving instance has room (a decode instance with free blocks but its batch full, a PREFILL one): the last
    resort took the freest, the one without a batch slot, which refuses the move, and the drain backed off while
    the PREFILL instance with a slot waited. A free batch slot goes first; among those, the freest."""
    draining = [peer("d", num_running=3, num_free_blocks=970, role=Role.DECODE, is_draining=True)]
    full_batch = peer("d2", role=Role.DECODE, num_free_slots=0)  # the freest: no request runs, none fits
    prefill = peer("p0", num_running=2, num_free_blocks=980, role=Role.PREFILL, num_free_slots=2)
    freer_prefill = peer("p1", num_running=1, num_free_blocks=990, role=Role.PREFILL)  # reports no slots: has one
    assert full_batch.freeness > freer_prefill.freeness > prefill.freeness
    assert pairs_of(pair_drains(draining, [full_batch, prefill])) == [("d", "p0")]
    assert pairs_of(pair_drains(draining, [full_batch, prefill, freer_prefill])) == [("d", "p1")]
    assert pairs_of(pair_drains(draining, [full_batch])) == [("d", "d2")]  # still a last resort when alone


def test_a_drain_waits_for_a_busy_decode_instance_rather_than_fall_back_to_a_prefill_one():
    # The last resort (a PREFILL destination) is for when no decoding instance has room, not for one whose
    # migration slots are busy for a while.
    draining = [peer("d", num_running=3, num_free_blocks=970, role=Role.DECODE, is_draining=True)]
    busy = peer("d2", num_running=2, num_free_blocks=980, role=Role.DECODE, num_free_migration_out_slots=0)
    prefill = peer("p0", role=Role.PREFILL)
    assert pairs_of(pair_drains(draining, [prefill, busy])) == []
    busy_prefill = peer("p1", role=Role.PREFILL, num_free_migration_out_slots=0)
    assert pairs_of(pair_drains(draining, [busy_prefill])) == []
