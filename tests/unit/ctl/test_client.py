import pytest

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2
from services.ctl.client import AdminClient, enum_label, instance_from_proto, request_from_proto


def test_instance_from_proto_names_enums_plainly():
    row = instance_from_proto(manager_pb2.InstanceInfo(
        instance_id="i-0", role=common_pb2.ROLE_PREFILL, state=common_pb2.INSTANCE_STATE_DRAINING,
        num_free_blocks=10, num_total_blocks=40, report_age_s=-1, prefix_cache_queried_tokens=80,
        prefix_cache_hit_tokens=60))
    assert (row.instance_id, row.role, row.state) == ("i-0", "prefill", "draining")
    assert row.kv_used_fraction == 0.75 and row.prefix_cache_hit_rate == 0.75
    assert (row.num_free_slots, row.max_num_seqs) == (None, 0)  # unset: not known, not 0 free


def test_instance_from_proto_keeps_zero_free_slots_apart_from_unknown():
    row = instance_from_proto(manager_pb2.InstanceInfo(instance_id="i-0", num_free_slots=0, max_num_seqs=4))
    assert (row.num_free_slots, row.max_num_seqs, row.slots) == (0, 4, "0/4")


def test_enum_label_keeps_unknown_numbers():
    assert enum_label(common_pb2.Role, 99, "ROLE_") == "99"


def test_request_from_proto():
    row = request_from_proto(instance_pb2.RequestInfo(request_id="r", instance_id="i", num_tokens=5, state="waiting"))
    assert (row.request_id, row.state, row.num_tokens, row.num_output_tokens) == ("r", "waiting", 5, 0)


async def test_set_role_checks_the_role():
    async with AdminClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="both, prefill, decode"):
            await client.set_role("i-0", "leader")
