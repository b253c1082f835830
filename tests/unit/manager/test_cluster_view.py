"""The cluster view and the dispatcher over it: states, exclusion, reservations."""

from __future__ import annotations

import pytest

from services.common.errors import Unavailable
from services.manager.cluster_view import IN_TRANSIT_S, ClusterView
from services.manager.dispatcher import Dispatcher
from services.manager.domain import DispatchAsk, InstanceId, InstanceRecord, InstanceState, Role
from services.manager.leadership import Leader, Leadership
from services.manager.scaling import ScalingSettings, decide
from tests.unit.manager.factories import FakeClock, make_load, make_record, make_view

pytestmark = pytest.mark.timeout(10)


def leading() -> Leadership:
    leadership = Leadership("m-1", "127.0.0.1:50051")
    leadership.set_elected(True)
    return leadership


def ask(request_id: str = "r", num_prompt_tokens: int = 160, exclude: tuple[str, ...] = ()) -> DispatchAsk:
    return DispatchAsk(request_id, num_prompt_tokens=num_prompt_tokens,
                       exclude_instance_ids=frozenset(InstanceId(i) for i in exclude))


def test_burst_spreads_over_equal_instances_through_reservations():
    view = make_view("a", "b", "c", "d", num_free_blocks=1000)
    dispatcher = Dispatcher(view, leading(), "load")
    picks = [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(8)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert picks[:4] == ["a", "b", "c", "d"]  # ties by id


def test_a_burst_fills_the_last_free_slot_then_goes_where_slots_are_free():
    """Each dispatch takes a slot of the reported ones (a reservation), so a freer instance with one slot
    left gets one request of the burst and the rest go to the instance that still has slots."""
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    for instance_id, load in (("a", make_load(num_free_blocks=4000, num_free_slots=1)),
                              ("b", make_load(num_free_blocks=1000, num_free_slots=4))):
        view.put_member(make_record(instance_id))
        view.apply_report(InstanceId(instance_id), load)
    dispatcher = Dispatcher(view, leading(), "load")
    assert [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(4)] == ["a", "b", "b", "b"]
    assert view.load_of(InstanceId("a")).num_free_slots == 0


def test_reservation_adds_prompt_blocks_and_a_running_request():
    view = make_view("a", num_free_blocks=1000)
    view.reserve(InstanceId("a"), 11)
    load = view.load_of(InstanceId("a"))
    assert (load.num_running, load.num_blocks_needed_by_waiting) == (1, 11)
    assert load.freeness == pytest.approx((1000 - 11) / 2)


def test_a_report_supersedes_the_reservations_made_well_before_it():
    clock = FakeClock()
    view = make_view("a", "b", clock=clock)
    dispatcher = Dispatcher(view, leading(), "load")
    assert dispatcher.dispatch(ask()).instance_id == "a"
    assert dispatcher.dispatch(ask()).instance_id == "b"
    clock.advance(IN_TRANSIT_S + 0.01)
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=1000))  # a reports, b still reserved
    assert dispatcher.dispatch(ask()).instance_id == "a"
    assert view.instance(InstanceId("a")).num_dispatched == 2


def test_a_report_right_after_a_dispatch_keeps_its_reservation():
    """The request may not have reached the instance yet: dropping its reservation made a burst pile
    onto whichever instance had just reported."""
    clock = FakeClock()
    view = make_view("a", "b", clock=clock)
    dispatcher = Dispatcher(view, leading(), "load")
    picks = [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(2)]
    for instance_id in ("a", "b"):  # both report before the requests arrive
        view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=1000))
    picks += [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(2, 8)]
    assert sorted(picks) == ["a"] * 4 + ["b"] * 4
    assert view.load_of(InstanceId("a")).num_running == 4


def counted(instance_id: str, num_running: int, num_requests_admitted: int,
            num_requests_migrated_in: int = 0) -> tuple[InstanceId, object]:
    """A report of `instance_id` running `num_running`, having taken in that many requests since it started."""
    return InstanceId(instance_id), make_load(num_running=num_running, num_requests_admitted=num_requests_admitted,
                                              num_requests_migrated_in=num_requests_migrated_in)


def test_a_report_that_counts_a_dispatched_request_drops_its_reservation_at_once():
    """Before, the report counted the request and its reservation stayed for IN_TRANSIT_S: admin showed
    num_running 6 and 6 for 3 + 3 streams (black-box run), and dispatch and migration saw that too."""
    clock = FakeClock()
    view = make_view("a", "b", clock=clock, num_requests_admitted=5)  # an instance that counts
    dispatcher = Dispatcher(view, leading(), "load")
    picks = [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(6)]
    assert sorted(picks) == ["a"] * 3 + ["b"] * 3
    clock.advance(0.05)
    view.apply_report(*counted("a", 3, 8))
    view.apply_report(*counted("b", 3, 8))
    assert [view.load_of(InstanceId(i)).num_running for i in ("a", "b")] == [3, 3]
    assert view.totals().num_running == 6


def test_a_dispatch_the_report_does_not_count_yet_stays_reserved():
    clock = FakeClock()
    view = make_view("a", clock=clock, num_requests_admitted=1)
    for _ in range(3):
        view.reserve(InstanceId("a"), 10)
        clock.advance(0.01)
    view.apply_report(*counted("a", 3, 3))  # two of the three arrived: the two oldest reservations go
    assert view.load_of(InstanceId("a")).num_running == 4
    view.reserve(InstanceId("a"), 10)  # newer than the report
    view.apply_report(*counted("a", 3, 3))  # counts nothing new
    assert view.load_of(InstanceId("a")).num_running == 5
    view.apply_report(*counted("a", 5, 5))
    assert view.load_of(InstanceId("a")).num_running == 5
    clock.advance(IN_TRANSIT_S)
    view.apply_report(*counted("a", 5, 5))  # still dropped by age alone
    assert view.load_of(InstanceId("a")).num_running == 5


def test_a_dispatch_to_a_windowed_instance_reserves_only_the_windows_blocks():
    """A request on an instance whose every layer has a 64-token window holds ceil(64 / 16) + 1 = 5 blocks at
    most, however long its prompt: the dispatch counts those (without the record's kv_window_tokens: all 63)."""
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    windowed = InstanceRecord.from_json("w", b'{"address": "h:1", "kv_window_tokens": 64,'
                                             b' "kv": {"block_size": 16, "num_blocks": 1000}}')
    older = InstanceRecord.from_json("o", b'{"address": "h:2", "kv": {"block_size": 16, "num_blocks": 1000}}')
    assert (windowed.kv_window_tokens, older.kv_window_tokens) == (64, 0)
    for record in (windowed, older):
        view.put_member(record)
        view.apply_report(record.instance_id, make_load(num_free_blocks=1000))
    dispatcher = Dispatcher(view, leading(), "load")
    long_prompt = ask("r", num_prompt_tokens=1000)
    assert (long_prompt.num_prompt_blocks(16, 64), long_prompt.num_prompt_blocks(16)) == (5, 63)
    assert ask("s", num_prompt_tokens=20).num_prompt_blocks(16, 64) == 2  # a short prompt: its own blocks
    for _ in range(2):  # the less loaded one each time: one dispatch to each
        dispatcher.dispatch(long_prompt)
    assert view.load_of(InstanceId("w")).num_blocks_needed_by_waiting == 5
    assert view.load_of(InstanceId("o")).num_blocks_needed_by_waiting == 63


def test_a_count_beyond_the_reservations_drops_only_what_there_is():
    """A frontend's local fallback (or a migration in) adds requests the manager reserved nothing for."""
    clock = FakeClock()
    view = make_view("a", clock=clock, num_requests_admitted=1)
    view.apply_report(*counted("a", 4, 5))
    view.reserve(InstanceId("a"), 10)
    assert view.load_of(InstanceId("a")).num_running == 5
    view.apply_report(*counted("a", 5, 6))
    assert view.load_of(InstanceId("a")).num_running == 5


def test_pd_placements_are_dropped_by_migrations_in_and_dispatches_by_generate_only():
    """A migration the manager placed nothing for (its migration loop's, an operator's) must not take a
    dispatch's reservation: that request may still be on its way."""
    clock = FakeClock()
    view = make_view("d", clock=clock, num_requests_admitted=1, num_requests_migrated_in=1)
    view.reserve(InstanceId("d"), 10)  # a dispatch
    view.reserve(InstanceId("d"), 10, is_dispatch=False)  # a PD placement
    view.apply_report(*counted("d", 1, 1, 2))  # the hand-off committed
    assert view.load_of(InstanceId("d")).num_running == 2
    view.apply_report(*counted("d", 2, 1, 3))  # a migration nobody placed: the dispatch stays reserved
    assert view.load_of(InstanceId("d")).num_running == 3
    view.apply_report(*counted("d", 3, 2, 3))
    assert view.load_of(InstanceId("d")).num_running == 3


def incoming(num_incoming_migrations: int, num_requests_migrated_in: int = 0, **load) -> object:
    return make_load(num_free_slots=2, num_free_migration_out_slots=2, num_incoming_migrations=num_incoming_migrations,
                     num_requests_migrated_in=num_requests_migrated_in, **load)


def test_a_migration_in_holds_a_slot_blocks_and_a_migration_slot_until_a_report_shows_it():
    """A destination's last report may predate a migration just started into it: picked again on it (a second
    migration in the same tick, an admin Migrate beside the loop, --migration-max-per-instance above 1), it
    refused the next one for the batch slot or migration slot the first had taken."""
    d = InstanceId("d")
    view = make_view("d")
    view.apply_report(d, incoming(0))
    first = view.begin_migration(InstanceId("s"), d, num_blocks=10)
    second = view.begin_migration(InstanceId("t"), d, num_blocks=10)
    load = view.load_of(d)
    assert (load.num_running, load.num_blocks_needed_by_waiting, load.num_free_slots,
            load.num_free_migration_out_slots) == (2, 20, 0, 0)
    assert not view.instance(d).load.has_free_migration_slot and view.instance(d).reported_load.num_running == 0
    view.apply_report(d, incoming(0))  # taken before either Prepare
    assert view.load_of(d).num_running == 2
    view.apply_report(d, incoming(1, num_free_blocks=990))  # the first one reserved there: its report counts it
    assert (view.load_of(d).num_running, view.load_of(d).num_blocks_needed_by_waiting) == (1, 10)
    view.apply_report(d, incoming(1, num_free_blocks=990))  # still that one: the second is not shown yet
    assert view.load_of(d).num_running == 1
    view.end_migration(InstanceId("s"), d, first)  # refused, say: the destination let go of its reservation
    assert view.load_of(d).num_running == 1  # the second is not shown yet
    view.apply_report(d, incoming(0, num_requests_migrated_in=1, num_running=1))  # the second committed at once
    assert view.load_of(d).num_running == 1
    view.end_migration(InstanceId("t"), d, second)
    assert view.load_of(d) == view.reported_load_of(d)


def test_a_migration_in_no_report_shows_is_held_until_it_ends():
    d = InstanceId("d")
    view = make_view("d", num_free_slots=1)
    token = view.begin_migration(InstanceId("s"), d, num_blocks=4)
    view.apply_report(d, make_load(num_free_slots=1))  # an instance that does not report incoming migrations
    assert view.load_of(d).num_free_slots == 0 and view.candidates()[0].load.num_free_slots == 0
    view.end_migration(InstanceId("s"), d, token)
    assert view.load_of(d).num_free_slots == 1 and view.candidates()[0].load.num_free_slots == 1


def test_a_count_that_went_down_is_a_new_baseline():
    """The instance restarted under its id: its count started again."""
    clock = FakeClock()
    view = make_view("a", clock=clock, num_requests_admitted=40)
    view.reserve(InstanceId("a"), 10)
    view.apply_report(*counted("a", 0, 2))  # 2 < 40: nothing known to be counted
    assert view.load_of(InstanceId("a")).num_running == 1
    view.apply_report(*counted("a", 1, 3))
    assert view.load_of(InstanceId("a")).num_running == 1


def test_a_new_report_stream_starts_from_a_baseline():
    clock = FakeClock()
    view = make_view("a", clock=clock, num_requests_admitted=2)
    view.note_report_stream_ended(InstanceId("a"), clock())
    view.reserve(InstanceId("a"), 10)
    view.apply_report(*counted("a", 1, 5))  # the first of a stream (maybe a restarted process): a baseline
    assert view.load_of(InstanceId("a")).num_running == 2
    view.apply_report(*counted("a", 2, 6))
    assert view.load_of(InstanceId("a")).num_running == 2


def test_an_instance_that_does_not_count_keeps_the_time_rule():
    clock = FakeClock()
    view = make_view("a", clock=clock)
    view.reserve(InstanceId("a"), 10)
    clock.advance(0.1)
    view.apply_report(*counted("a", 1, 0))
    assert view.load_of(InstanceId("a")).num_running == 2
    clock.advance(IN_TRANSIT_S)
    view.apply_report(*counted("a", 1, 0))
    assert view.load_of(InstanceId("a")).num_running == 1


def test_queue_policy_burst_spreads_too():
    view = make_view("a", "b", "c")
    dispatcher = Dispatcher(view, leading(), "queue")
    assert [dispatcher.dispatch(ask()).instance_id for _ in range(3)] == ["a", "b", "c"]


def test_draining_instance_is_never_chosen():
    view = make_view("a", "b", num_free_blocks=1000)
    view.apply_report(InstanceId("b"), make_load(num_free_blocks=10))
    view.mark_drained(InstanceId("a"))
    dispatcher = Dispatcher(view, leading(), "load")
    assert {dispatcher.dispatch(ask()).instance_id for _ in range(5)} == {"b"}
    assert view.state_of(InstanceId("a")) is InstanceState.DRAINING


def test_record_saying_draining_counts_as_draining():
    view = make_view("a")
    view.put_member(make_record("a", is_draining=True))
    assert view.state_of(InstanceId("a")) is InstanceState.DRAINING
    assert view.candidates() == []


def test_silent_instance_turns_unhealthy_and_back():
    clock = FakeClock()
    view = make_view("a", "b", clock=clock, report_timeout_s=3.0)
    clock.advance(2.0)
    view.apply_report(InstanceId("b"), make_load())
    clock.advance(2.0)  # a silent for 4 s, b for 2 s
    assert view.state_of(InstanceId("a")) is InstanceState.UNHEALTHY
    assert [c.instance_id for c in view.candidates()] == ["b"]
    view.apply_report(InstanceId("a"), make_load())
    assert view.state_of(InstanceId("a")) is InstanceState.SERVING


def test_new_member_gets_a_grace_before_its_first_report():
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    view.put_member(make_record("a", num_blocks=500))
    assert view.state_of(InstanceId("a")) is InstanceState.SERVING
    assert view.load_of(InstanceId("a")).num_free_blocks == 500
    clock.advance(3.5)
    assert view.state_of(InstanceId("a")) is InstanceState.UNHEALTHY


def test_start_leading_restarts_the_grace():
    clock = FakeClock()
    view = make_view("a", clock=clock)
    clock.advance(60)
    assert view.state_of(InstanceId("a")) is InstanceState.UNHEALTHY
    view.start_leading()
    assert view.state_of(InstanceId("a")) is InstanceState.SERVING


def test_exclude_and_decode_only_are_skipped_while_a_prefill_instance_serves():
    view = make_view("a", "b", "c")
    view.put_member(make_record("c", role=Role.DECODE))
    dispatcher = Dispatcher(view, leading(), "flood")
    placement = dispatcher.dispatch(ask(exclude=("a",)))
    assert placement.instance_id == "b" and not placement.can_prefill_on_decode
    with pytest.raises(Unavailable, match=r"3 excluded by the caller"):
        dispatcher.dispatch(ask(exclude=("a", "b", "c")))


def test_standby_without_a_known_leader_says_so():
    with pytest.raises(Unavailable, match="no leader is elected yet"):
        Dispatcher(make_view("a"), Leadership("m-2", "x:1")).dispatch(ask())


def test_no_instance_is_unavailable_with_a_hint():
    dispatcher = Dispatcher(ClusterView(report_timeout_s=3.0), leading())
    with pytest.raises(Unavailable, match="no instance is registered"):
        dispatcher.dispatch(ask())


def test_elected_leader_whose_lease_may_have_expired_dispatches_nothing():
    lease = {"held": True}
    leadership = Leadership("m-1", "127.0.0.1:50051", holds_lease=lambda: lease["held"])
    leadership.set_elected(True)
    dispatcher = Dispatcher(make_view("a"), leadership)
    assert dispatcher.dispatch(ask()).instance_id == "a"
    lease["held"] = False  # e.g. woke up from a freeze longer than the TTL, not yet told it lost
    assert not leadership.is_leader
    with pytest.raises(Unavailable, match="no leader is elected yet"):
        dispatcher.dispatch(ask())


def test_standby_refuses_and_names_the_leader():
    leadership = Leadership("m-2", "127.0.0.1:50052")
    leadership.set_watched_leader(Leader("m-1", "127.0.0.1:50051"))
    with pytest.raises(Unavailable, match="not the leader; leader is at 127.0.0.1:50051"):
        Dispatcher(make_view("a"), leadership).dispatch(ask())


def test_replace_members_drops_the_gone_and_keeps_survivors_load():
    view = make_view("a", "b", num_free_blocks=123)
    view.replace_members([make_record("b"), make_record("c")])
    assert view.member_ids() == ["b", "c"]
    assert view.load_of(InstanceId("b")).num_free_blocks == 123


def test_totals_average_serving_freeness():
    view = make_view("a", "b", num_free_blocks=100, num_running=1)
    view.mark_drained(InstanceId("b"))
    totals = view.totals()
    assert (totals.num_instances, totals.num_serving, totals.num_running) == (2, 1, 2)
    assert totals.average_freeness == pytest.approx(50.0)


def test_record_from_json_reads_kv_geometry_and_rejects_garbage():
    record = InstanceRecord.from_json("i-1", b'{"address": "h:1", "role": "prefill", "pid": 7, "host": "h",'
                                             b' "model": "m", "kv": {"block_size": 32, "num_blocks": 64}}')
    assert (record.role, record.block_size, record.num_blocks, record.pid) == (Role.PREFILL, 32, 64, 7)
    assert record.max_model_len == 0  # not in the record: not known
    assert InstanceRecord.from_json("i-1", b'{"address": "h:1", "max_model_len": 1024}').max_model_len == 1024
    with pytest.raises(ValueError, match="no address"):
        InstanceRecord.from_json("i-2", b"{}")
    with pytest.raises(ValueError, match="role 'gpu'"):
        InstanceRecord.from_json("i-3", b'{"address": "h:1", "role": "gpu"}')


def test_candidates_follow_record_changes_and_reports():
    view = make_view("a", num_free_blocks=100)
    assert view.candidates()[0].freeness == pytest.approx(100)
    moved = InstanceRecord(InstanceId("a"), "10.0.0.9:1", num_blocks=1000)
    view.put_member(moved)
    assert view.candidates()[0].address == "10.0.0.9:1"
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=40, num_running=1))
    assert view.candidates()[0].freeness == pytest.approx(20)
    view.put_member(make_record("a", role=Role.DECODE))
    assert view.candidates() == []


def test_report_age_is_none_before_the_first_report_of_this_term():
    clock = FakeClock()
    view = make_view("a", clock=clock)
    clock.advance(0.5)
    assert view.instance(InstanceId("a")).report_age_s == pytest.approx(0.5)
    view.start_leading()
    assert view.instance(InstanceId("a")).report_age_s is None


def test_an_instance_a_peer_could_not_reach_is_left_out_until_it_reports_again():
    """A prefill instance's hand-off to a decode instance that died failed UNAVAILABLE: placements
    must stop going there at once, not once its lease ends (found by a black-box run: 17 failed
    hand-offs to a killed instance in 3 s)."""
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    for instance_id, role in (("p", Role.PREFILL), ("d1", Role.DECODE), ("d2", Role.DECODE)):
        view.put_member(make_record(instance_id, role=role))
        view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=900 if instance_id == "d1" else 500))
    dispatcher = Dispatcher(view, leading())
    assert dispatcher.place_decode("r-1", "p", 0).instance_id == "d1"  # the freer one
    view.mark_unanswered(InstanceId("d1"))
    assert view.state_of(InstanceId("d1")) is InstanceState.UNHEALTHY
    assert dispatcher.place_decode("r-2", "p", 0).instance_id == "d2"
    view.apply_report(InstanceId("d1"), make_load(num_free_blocks=900))  # alive after all
    assert view.state_of(InstanceId("d1")) is InstanceState.SERVING
    assert dispatcher.place_decode("r-3", "p", 0).instance_id == "d1"
    view.mark_unanswered(InstanceId("gone"))  # not a member: nothing to do


def test_after_a_takeover_an_instance_that_reports_is_preferred_to_a_silent_one():
    """A silent instance in its grace looks empty: a dead one whose key outlived it (its stream had
    ended) drew 10 of 12 dispatches from the new leader while the live one already reported."""
    clock = FakeClock()
    view = make_view("a", "b", clock=clock, num_free_blocks=600, num_running=4)
    view.mark_unanswered(InstanceId("b"))  # its report stream ended: killed
    view.start_leading()  # a new term: every member gets a fresh grace
    clock.advance(0.2)
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=600, num_running=4))
    dispatcher = Dispatcher(view, leading(), "load")
    assert {dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(12)} == {"a"}
    assert view.state_of(InstanceId("b")) is InstanceState.SERVING  # still in its grace: used if alone
    assert dispatcher.dispatch(ask(exclude=("a",))).instance_id == "b"


def test_a_burst_right_after_start_spreads_over_an_instance_that_has_not_reported_yet():
    """A deployment without the launcher's wait for first reports (systemd, docker compose): the leader passed over
    an instance in its first grace while another had reported, so a burst right after start all went to the one that
    reported first. One that registered in this term is a live process: taken as idle until its first report. A
    member left from before the term (maybe a dead instance's key) still draws nothing while another reports."""
    clock = FakeClock()
    view = ClusterView(report_timeout_s=3.0, clock=clock)
    view.put_member(make_record("old"))  # there when this manager took office, silent since
    view.start_leading()
    for instance_id in ("a", "b"):
        view.put_member(make_record(instance_id))
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=1000))
    dispatcher = Dispatcher(view, leading(), "load")
    picks = [dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(8)]
    assert sorted(picks) == ["a"] * 4 + ["b"] * 4, picks
    clock.advance(3.5)  # b never reported: its grace is over
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=1000))
    assert [c.instance_id for c in view.candidates()] == ["a"]


def test_members_first_seen_after_a_takeover_before_the_membership_was_read_are_not_vouched_for():
    """A leader that took office before its etcd membership view had read anything sees every member first after
    that, dead instances' leftover keys too: none of them draws dispatches while another reports."""
    view = ClusterView(report_timeout_s=3.0, clock=FakeClock())
    view.start_leading(is_membership_read=False)
    for instance_id in ("a", "dead"):
        view.put_member(make_record(instance_id))
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=100))
    dispatcher = Dispatcher(view, leading(), "load")
    assert {dispatcher.dispatch(ask(f"r-{n}")).instance_id for n in range(4)} == {"a"}
    view.start_leading()  # the next term, over a membership read by then: both were there before it
    view.apply_report(InstanceId("a"), make_load(num_free_blocks=100))
    assert {dispatcher.dispatch(ask(f"s-{n}")).instance_id for n in range(4)} == {"a"}


def test_a_new_instance_is_dispatched_to_once_it_reports():
    view = make_view("a", num_free_blocks=100, num_running=4)
    view.put_member(make_record("b"))
    dispatcher = Dispatcher(view, leading(), "load")
    assert dispatcher.dispatch(ask()).instance_id == "a"
    view.apply_report(InstanceId("b"), make_load(num_free_blocks=1000))
    assert dispatcher.dispatch(ask()).instance_id == "b"


def test_a_migration_in_flight_counts_once_in_the_pooled_freeness_scaling_keeps_in_its_band():
    """The destination holds a migration in flight (a running request, its blocks) until a report there shows it,
    while the source's report still counts the request: pooled over both, it counted twice, and a burst of moves
    looked like more load than there was (scaling added an instance). Once where both are in the pool; a request
    coming in from outside it (a draining instance) does add load to it."""
    s, d = InstanceId("s"), InstanceId("d")
    view = make_view("s", "d", num_total_blocks=100, num_free_blocks=100)
    view.apply_report(s, make_load(num_running=8, num_free_blocks=20, num_total_blocks=100))
    assert view.totals().average_freeness == 12.0  # (20 + 100) / (8 + 2)
    settings = ScalingSettings(is_enabled=True, low_freeness=11.0, high_freeness=50.0, max_instances=4)
    token = view.begin_migration(s, d, num_blocks=10)
    assert view.totals().average_freeness == 12.0  # not (20 + 100 - 10) / (8 + 1 + 2) = 10, under the band
    assert view.totals().num_running == 8  # GetClusterStatus: one request moving, not two
    assert decide(view.instances(), settings) is None
    assert view.load_of(d).num_running == 1  # the destination's own load still holds it (pairing, dispatch)
    view.end_migration(s, d, token)
    view.put_member(make_record("x", is_draining=True))
    view.apply_report(InstanceId("x"), make_load(num_running=1, num_free_blocks=90, num_total_blocks=100))
    view.begin_migration(InstanceId("x"), d, num_blocks=10)
    assert view.totals().average_freeness == 10.0  # x is not serving: its request comes into the pool
    assert view.totals().num_running == 9  # but x is a member: its report counts the request (8 on s, 1 on x)
