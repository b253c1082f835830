"""Load reports in, instance rows out: the prefix cache counters survive both conversions and
reservations (dispatches not yet reported) never touch them."""

import pytest

from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2
from services.manager.convert import (dispatch_ask_from_proto, held_request_from_proto, instance_to_proto, load_from_proto,
                                      migrate_response_to_proto,
                                      migration_figures_from_proto, migration_record_to_proto,
                                      reported_migration_from_proto)
from services.manager.domain import InstanceId, InstanceRecord, InstanceState, InstanceView, Reservation
from services.manager.migration import (MigrationOrder, MigrationOutcome, MigrationRecord, MigrationSelection,
                                        MigrationTrigger)
from services.manager.migration_settle import HeldRequest, RequestOrigin


def test_prefix_cache_counters_reach_the_instance_row():
    load = load_from_proto(common_pb2.LoadReport(num_running=1, num_free_blocks=10, num_total_blocks=16,
                                                 prefix_cache_queried_tokens=512, prefix_cache_hit_tokens=384))
    reserved = load.plus(Reservation(num_requests=1, num_blocks=3))
    assert (reserved.num_running, reserved.num_blocks_needed_by_waiting) == (2, 3)
    assert (reserved.num_prefix_queried_tokens, reserved.num_prefix_hit_tokens) == (512, 384)
    view = InstanceView(InstanceRecord(InstanceId("i-0"), "127.0.0.1:1"), InstanceState.SERVING, reserved,
                        num_dispatched=1, report_age_s=0.1)
    info = instance_to_proto(view)
    assert (info.prefix_cache_queried_tokens, info.prefix_cache_hit_tokens) == (512, 384)


def test_negative_counters_are_refused_by_name():
    with pytest.raises(InvalidArgument, match="prefix_cache_hit_tokens"):
        load_from_proto(common_pb2.LoadReport(prefix_cache_hit_tokens=-1))


def test_priority_headroom_counts_against_freeness_as_the_instance_computes_it():
    load = load_from_proto(common_pb2.LoadReport(num_running=1, num_free_blocks=40, num_blocks_needed_by_waiting=6,
                                                 num_headroom_blocks=10))
    assert load.freeness == pytest.approx((40 - 6 - 10) / 2)
    with pytest.raises(InvalidArgument, match="num_headroom_blocks"):
        load_from_proto(common_pb2.LoadReport(num_headroom_blocks=-1))


def test_the_count_of_requests_taken_in_reaches_the_view_and_a_negative_one_is_refused():
    load = load_from_proto(common_pb2.LoadReport(num_requests_admitted=12, num_requests_migrated_in=3))
    assert (load.num_requests_admitted, load.num_requests_migrated_in) == (12, 3)
    with pytest.raises(InvalidArgument, match="num_requests_migrated_in"):
        load_from_proto(common_pb2.LoadReport(num_requests_migrated_in=-1))


def test_free_batch_slots_reach_the_view_unknown_from_an_older_instance_and_a_dispatch_takes_one():
    assert load_from_proto(common_pb2.LoadReport(num_free_slots=0)).num_free_slots == 0
    assert load_from_proto(common_pb2.LoadReport()).num_free_slots is None
    load = load_from_proto(common_pb2.LoadReport(num_free_slots=2))
    assert [load.plus(Reservation(n, 4 * n)).num_free_slots for n in (1, 2, 3)] == [1, 0, 0]
    assert load_from_proto(common_pb2.LoadReport()).plus(Reservation(1, 4)).num_free_slots is None
    with pytest.raises(InvalidArgument, match="num_free_slots"):
        load_from_proto(common_pb2.LoadReport(num_free_slots=-1))


def test_free_slots_less_reservations_and_the_record_s_batch_size_reach_the_instance_row():
    record = InstanceRecord.from_dict("i-0", {"address": "127.0.0.1:1", "max_num_seqs": 8})
    reserved = load_from_proto(common_pb2.LoadReport(num_free_slots=3)).plus(Reservation(1, 4))
    info = instance_to_proto(InstanceView(record, InstanceState.SERVING, reserved, num_dispatched=1, report_age_s=0.1))
    assert (info.HasField("num_free_slots"), info.num_free_slots, info.max_num_seqs) == (True, 2, 8)
    older = InstanceRecord.from_dict("i-1", {"address": "127.0.0.1:2"})  # no max_num_seqs, no slots reported
    info = instance_to_proto(InstanceView(older, InstanceState.SERVING, load_from_proto(common_pb2.LoadReport()),
                                          num_dispatched=0, report_age_s=0.1))
    assert (info.HasField("num_free_slots"), info.max_num_seqs) == (False, 0)
    hand_edited = InstanceRecord.from_dict("i-2", {"address": "127.0.0.1:3", "max_num_seqs": -4})
    assert hand_edited.max_num_seqs == 0  # shown as not known ("?"), never as "-4"


def test_a_reported_pd_hand_off_that_failed_is_kept_as_failed_with_its_reason():
    msg = manager_pb2.MigrationRecord(request_id="r-1", src_instance_id="p-0", dst_instance_id="d-0", trigger="pd",
                                      outcome="failed", reason="UNAVAILABLE", message="decode instance gone",
                                      duration_ms=3.0, started_at=5.0)
    record = reported_migration_from_proto(msg, "127.0.0.1:1", "127.0.0.1:2")
    assert record.outcome is MigrationOutcome.FAILED and (record.reason, record.message) == ("UNAVAILABLE",
                                                                                           "decode instance gone")
    assert record.figures.request_id == "r-1" and record.order.dst_instance_id == "d-0"
    # The decode instance had no room: refused, whether the instance says failed (as every one does) or refused
    for outcome in ("failed", "refused"):
        msg.outcome, msg.reason = outcome, "RESOURCE_EXHAUSTED"
        refused = reported_migration_from_proto(msg, "", "")
        assert (refused.outcome, refused.reason) == (MigrationOutcome.REFUSED, "RESOURCE_EXHAUSTED")
    msg.reason = "x" * 300  # a metrics label: only gRPC status names pass
    assert reported_migration_from_proto(msg, "", "").reason == "UNKNOWN"
    msg.outcome = "exploded"
    with pytest.raises(InvalidArgument, match="outcome"):
        reported_migration_from_proto(msg, "", "")
    msg.outcome = ""  # instances before this field was read: committed
    assert reported_migration_from_proto(msg, "", "").is_committed


def test_the_blocks_reused_at_the_destination_reach_the_admin_answer_and_the_history():
    reply = instance_pb2.MigrateOutResponse(request_id="r-1", num_blocks=5, num_cached_at_destination=3)
    figures = migration_figures_from_proto(reply)
    assert figures.num_cached_at_destination == 3
    order = MigrationOrder(InstanceId("a"), "127.0.0.1:1", InstanceId("b"), "127.0.0.1:2", MigrationTrigger.ADMIN,
                           MigrationSelection.SHORTEST_RUNNING, request_id="r-1")
    record = MigrationRecord(order, MigrationOutcome.COMMITTED, figures, 5.0)
    assert migrate_response_to_proto(record).num_cached_at_destination == 3
    reported = migration_record_to_proto(record)
    assert reported.num_cached_at_destination == 3
    assert reported_migration_from_proto(reported, "", "").figures.num_cached_at_destination == 3
    reported.num_cached_at_destination = -1
    with pytest.raises(InvalidArgument, match="num_cached_at_destination"):
        reported_migration_from_proto(reported, "", "")


def test_a_held_request_names_the_migration_that_brought_it():
    info = instance_pb2.RequestInfo(request_id="r", state="running", origin=instance_pb2.REQUEST_ORIGIN_MIGRATED_IN,
                                    migrated_from_instance_id="a", migration_id="a-0123")
    assert held_request_from_proto(info) == HeldRequest(RequestOrigin.MIGRATED_IN, "a", "a-0123")


def test_a_dispatch_without_a_request_id_is_refused_naming_the_field():
    """Dispatch {} placed a request (counting a reservation for one that would never come, logged with an
    empty request_id) where every other RPC that takes a request refuses it (h_ops7, reflection)."""
    with pytest.raises(InvalidArgument, match="^request_id: required"):
        dispatch_ask_from_proto(manager_pb2.DispatchRequest(num_prompt_tokens=3))
    assert dispatch_ask_from_proto(manager_pb2.DispatchRequest(request_id="r-1", num_prompt_tokens=3)).request_id == "r-1"
