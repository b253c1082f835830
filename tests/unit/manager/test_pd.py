"""Prefill/decode disaggregation in the manager, without sockets: dispatch by role (and its fallback
when a role is missing), PlaceDecode, the short-prompt rule, and the PD pairs of the migration loop."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import ResourceExhausted, Unavailable
from services.manager import metrics
from services.manager.cluster_view import ClusterView
from services.manager.dispatcher import Dispatcher
from services.manager.domain import DispatchAsk, InstanceId, Load, Role
from services.manager.leadership import Leadership
from services.manager.migration import MigrationSelection, MigrationTrigger
from services.manager.migration_policies import Peer, pair_prefilled
from services.manager.migrator import Migrator, MigratorLimits
from tests.unit.manager.factories import FakeClock, make_load, make_record

pytestmark = pytest.mark.timeout(10)


def leading() -> Leadership:
    leadership = Leadership("m-1", "127.0.0.1:1")
    leadership.set_elected(True)
    return leadership


def pd_view(clock: FakeClock | None = None, **roles: Role) -> ClusterView:
    view = ClusterView(report_timeout_s=3.0, clock=clock or FakeClock())
    for instance_id, role in roles.items():
        view.put_member(make_record(instance_id, role=role))
        view.apply_report(InstanceId(instance_id), make_load())
    return view


def ask(num_prompt_tokens: int = 160, exclude: tuple[str, ...] = ()) -> DispatchAsk:
    return DispatchAsk("r", num_prompt_tokens=num_prompt_tokens,
                       exclude_instance_ids=frozenset(InstanceId(i) for i in exclude))


def missing(dispatcher: Dispatcher, role: Role) -> float:
    """ferry_manager_pd_role_missing{role} as the leader's /metrics shows it."""
    registry = CollectorRegistry()
    registry.register(metrics.RoleGapCollector(dispatcher.role_gaps.is_missing, leading()))
    return registry.get_sample_value("ferry_manager_pd_role_missing", {"role": role.value})


def test_new_requests_go_to_prefill_instances_only():
    dispatcher = Dispatcher(pd_view(p=Role.PREFILL, d1=Role.DECODE, d2=Role.DECODE), leading(), "round_robin")
    placements = [dispatcher.dispatch(ask()) for _ in range(4)]
    assert {p.instance_id for p in placements} == {"p"}
    assert not any(p.can_prefill_on_decode for p in placements)


def test_no_prefill_instance_falls_back_to_decode_instances_and_heals():
    view = pd_view(p=Role.PREFILL, d=Role.DECODE)
    dispatcher = Dispatcher(view, leading())
    before = metrics.PD_ROLE_FALLBACKS.labels("prefill")._value.get()
    placement = dispatcher.dispatch(ask(exclude=("p",)))  # the prefill instance is gone for this request
    assert placement.instance_id == "d" and placement.can_prefill_on_decode
    assert metrics.PD_ROLE_FALLBACKS.labels("prefill")._value.get() == before + 1
    assert missing(dispatcher, Role.PREFILL) == 1 and dispatcher.role_gaps.is_missing(Role.PREFILL)
    assert dispatcher.dispatch(ask()).instance_id == "p"  # back: healed
    assert missing(dispatcher, Role.PREFILL) == 0 and not dispatcher.role_gaps.is_missing(Role.PREFILL)


async def test_a_gap_closes_once_the_role_serves_again_with_no_request_asking():
    """ferry_manager_pd_role_missing says 1 only while no instance of the role serves."""
    view = pd_view(p=Role.PREFILL)
    dispatcher = Dispatcher(view, leading())
    with pytest.raises(Unavailable):
        dispatcher.place_decode("r", "p", num_blocks=1)
    assert missing(dispatcher, Role.DECODE) == 1
    await dispatcher._refresh_role_gaps()
    assert missing(dispatcher, Role.DECODE) == 1  # still no decode instance
    view.put_member(make_record("d", role=Role.DECODE))  # e.g. SetRole on another instance
    view.apply_report(InstanceId("d"), make_load())
    await dispatcher._refresh_role_gaps()
    assert missing(dispatcher, Role.DECODE) == 0 and not dispatcher.role_gaps.is_missing(Role.DECODE)


def test_a_pd_placement_is_not_counted_as_a_dispatch():
    """num_dispatched (ListInstances, GetClusterStatus) counts new requests, as ferry_manager_dispatches_total does."""
    view = pd_view(p=Role.PREFILL, d=Role.DECODE)
    dispatcher = Dispatcher(view, leading())
    dispatcher.dispatch(ask())
    dispatcher.place_decode("r", "p", num_blocks=2)
    assert view.totals().num_dispatched == 1 and view.instance(InstanceId("d")).num_dispatched == 0


def test_short_prompt_rule_lets_decode_instances_prefill():
    view = pd_view(p=Role.PREFILL, d=Role.DECODE)
    view.apply_report(InstanceId("p"), make_load(num_free_blocks=10, num_running=5))  # busy prefill instance
    off = Dispatcher(view, leading())
    assert off.dispatch(ask(num_prompt_tokens=8)).instance_id == "p"
    on = Dispatcher(view, leading(), short_prompt_tokens=32)
    short = on.dispatch(ask(num_prompt_tokens=8))
    assert short.instance_id == "d" and short.can_prefill_on_decode
    assert on.dispatch(ask(num_prompt_tokens=200)).instance_id == "p"


def test_place_decode_picks_the_freest_decode_instance_and_reserves_it():
    view = pd_view(p=Role.PREFILL, d1=Role.DECODE, d2=Role.DECODE, b=Role.BOTH)
    view.apply_report(InstanceId("d1"), make_load(num_free_blocks=100, num_running=3))
    dispatcher = Dispatcher(view, leading())
    first = dispatcher.place_decode("r1", "p", 4)
    assert first.instance_id == "d2"
    assert view.load_of(InstanceId("d2")).num_running == 1  # reserved until its next report


def test_place_decode_passes_over_decode_instances_serving_shorter_sequences_than_the_request_may_reach():
    # Found outside-in: a decode instance with --max-model-len 256 and the most free blocks drew hand-offs of
    # requests that may reach ~350 tokens and refused each (they decoded on the prefill instance instead).
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    for instance_id, role, max_model_len in [("p", Role.PREFILL, 1024), ("short", Role.DECODE, 256),
                                             ("long", Role.DECODE, 1024)]:
        view.put_member(dataclasses.replace(make_record(instance_id, role=role), max_model_len=max_model_len))
        view.apply_report(InstanceId(instance_id), make_load())
    view.apply_report(InstanceId("long"), make_load(num_free_blocks=500, num_running=3))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r1", "p", 4, max_num_tokens=300).instance_id == "long"
    assert dispatcher.place_decode("r2", "p", 4, max_num_tokens=256).instance_id == "short"  # fits: the freest
    assert dispatcher.place_decode("r3", "p", 4).instance_id == "short"  # reach not known: by load alone
    view.remove_member(InstanceId("long"))
    with pytest.raises(Unavailable, match="no decode instance serves sequences of 300 tokens"):
        dispatcher.place_decode("r4", "p", 4, max_num_tokens=300)


SMOL = {"kv_layout": (30, 3, 64, 16, "float32"), "vocab_size": 49152, "model_fingerprint": "1111111111111111"}


# A black-box run on three "hosts" (2026-12-07): an instance of another model, the freest, drew every move (each
# failed "kv geometry mismatch"). Another fine-tune of the base (same layout and vocabulary, other weights) is
# passed over as well: a hand-off goes to a decode instance of the source's model and fingerprint.
@pytest.mark.parametrize("other", [{"kv_layout": (3, 2, 16, 16, "float32"), "vocab_size": 512},
                                   {"model_fingerprint": "2222222222222222"}], ids=["other_model", "other_fine_tune"])
def test_place_decode_passes_over_decode_instances_of_another_model(other):
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    for instance_id, role, fields in [("p", Role.PREFILL, SMOL), ("d", Role.DECODE, SMOL),
                                      ("other", Role.DECODE, {**SMOL, **other})]:
        view.put_member(dataclasses.replace(make_record(instance_id, role=role), **fields))
        view.apply_report(InstanceId(instance_id), make_load())
    view.apply_report(InstanceId("d"), make_load(num_free_blocks=500, num_running=3))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r1", "p", 4).instance_id == "d"
    view.remove_member(InstanceId("d"))
    with pytest.raises(Unavailable, match="no decode instance serves"):
        dispatcher.place_decode("r2", "p", 4)


def test_place_decode_without_decode_instances_is_unavailable_and_counted():
    view = pd_view(p=Role.PREFILL, q=Role.PREFILL)
    dispatcher = Dispatcher(view, leading())
    before = metrics.PD_ROLE_FALLBACKS.labels("decode")._value.get()
    with pytest.raises(Unavailable, match="no decode instance serves"):
        dispatcher.place_decode("r1", "p", 4)
    assert metrics.PD_ROLE_FALLBACKS.labels("decode")._value.get() == before + 1
    assert missing(dispatcher, Role.DECODE) == 1
    view.put_member(make_record("d", role=Role.DECODE))
    assert dispatcher.place_decode("r2", "p", 4).instance_id == "d"
    assert missing(dispatcher, Role.DECODE) == 0


def peer(instance_id: str, role: Role, num_prefilled: int = 0, num_free_blocks: int = 100) -> Peer:
    load = Load(num_running=num_prefilled, num_free_blocks=num_free_blocks, num_total_blocks=100,
                num_prefilled=num_prefilled)
    return Peer(InstanceId(instance_id), f"addr-{instance_id}", role, load, load.freeness, is_draining=False)


def test_pair_prefilled_moves_from_prefill_to_the_freest_decode_peers():
    pairs = pair_prefilled([peer("p1", Role.PREFILL, 2), peer("p2", Role.PREFILL, 1), peer("p3", Role.PREFILL, 0),
                            peer("d1", Role.DECODE, num_free_blocks=50), peer("d2", Role.DECODE),
                            peer("b", Role.BOTH)])
    assert [(p.src.instance_id, p.dst.instance_id, p.trigger) for p in pairs] == [
        ("p1", "d2", MigrationTrigger.PD), ("p2", "d1", MigrationTrigger.PD)]


def test_pair_prefilled_without_decode_peers_moves_requests_to_a_mixed_instance_as_place_decode_does():
    [pair] = pair_prefilled([peer("p1", Role.PREFILL, 3), peer("b", Role.BOTH)])
    assert (pair.src.instance_id, pair.dst.instance_id) == ("p1", "b")
    assert pair_prefilled([peer("p1", Role.PREFILL, 3)]) == []


def test_pair_prefilled_waits_for_a_full_decode_peer_rather_than_a_mixed_one():
    full = peer("d", Role.DECODE, num_free_blocks=0)
    assert pair_prefilled([peer("p1", Role.PREFILL, 3), full, peer("b", Role.BOTH)]) == []


def test_migration_loop_orders_one_stage_hand_offs_of_prefilled_requests():
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    for instance_id, role in (("p", Role.PREFILL), ("d", Role.DECODE)):
        view.put_member(make_record(instance_id, role=role))
    view.apply_report(InstanceId("p"), dataclasses.replace(make_load(num_running=2, num_free_blocks=900),
                                                           num_prefilled=2))
    view.apply_report(InstanceId("d"), make_load())
    migrator = Migrator(view, leading(), client=None, limits=MigratorLimits(), clock=clock)
    [order] = migrator.plan()  # the load-balancing loop is off: PD hand-offs run regardless
    assert (order.src_instance_id, order.dst_instance_id, order.trigger) == ("p", "d", MigrationTrigger.PD)
    assert order.selection is MigrationSelection.PREFILL_DONE and order.max_stages == 0


def test_place_decode_prefers_a_decode_instance_with_room_for_the_requests_blocks():
    """The freest by freeness may lack the blocks (or a batch slot) of a long request: it would refuse the copy."""
    view = pd_view(p=Role.PREFILL, d1=Role.DECODE, d2=Role.DECODE, d3=Role.DECODE)
    view.apply_report(InstanceId("d1"), make_load(num_free_blocks=100, num_total_blocks=100))  # freest, too small
    view.apply_report(InstanceId("d2"), make_load(num_free_blocks=300, num_running=5, num_free_slots=0))  # no slot
    view.apply_report(InstanceId("d3"), make_load(num_free_blocks=400, num_running=5))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r1", "p", 150).instance_id == "d3"
    assert view.load_of(InstanceId("d3")).num_blocks_needed_by_waiting == 150  # counted until d3 reports it
    assert dispatcher.place_decode("r2", "p", 20).instance_id == "d1"  # room enough: the freest
    # none has room (a stale view, or a request larger than any): the freest still gets to say
    assert dispatcher.place_decode("r3", "p", 10_000).instance_id == "d1"


def test_place_decode_prefers_a_decode_instance_with_a_free_migration_slot():
    """One whose migration slots (one pool, in and out) its own migrations hold refuses the hand-off at once: the
    push spent one of its few tries (and a round trip) there while another decode instance was free."""
    view = pd_view(p=Role.PREFILL, d1=Role.DECODE, d2=Role.DECODE)
    view.apply_report(InstanceId("d1"), make_load(num_free_blocks=900, num_free_migration_out_slots=0))  # freest
    view.apply_report(InstanceId("d2"), make_load(num_free_blocks=400, num_running=5, num_free_migration_out_slots=1))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r1", "p", 10).instance_id == "d2"
    view.apply_report(InstanceId("d2"), make_load(num_free_blocks=400, num_running=5, num_free_migration_out_slots=0))
    assert dispatcher.place_decode("r2", "p", 10).instance_id == "d1"  # all busy: the freest still gets to say


def test_place_decode_skips_the_decode_instances_that_refused_and_says_when_none_is_left():
    view = pd_view(p=Role.PREFILL, d1=Role.DECODE, d2=Role.DECODE, b=Role.BOTH)
    view.apply_report(InstanceId("d2"), make_load(num_free_blocks=500))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r", "p", 4).instance_id == "d1"
    assert dispatcher.place_decode("r", "p", 4, refused=frozenset({InstanceId("d1")})).instance_id == "d2"
    with pytest.raises(ResourceExhausted, match="every decode instance refused request r"):
        dispatcher.place_decode("r", "p", 4, refused=frozenset({InstanceId("d1"), InstanceId("d2")}))
    assert missing(dispatcher, Role.DECODE) == 0  # full is not missing: no role fallback counted
