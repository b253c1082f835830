"""Ids name etcd keys, log fields and files: one safe word, bounded; callers name the field."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.ids import MAX_ID_CHARS, check_id, default_id, host_word, id_problem


@pytest.mark.parametrize("value", ["instance-0", "host.example.com-50052", "m_1", "a", "node:7@rack-2"])
def test_ids_in_use_are_ids(value):
    assert id_problem(value) is None and check_id("instance_id", value) == value


@pytest.mark.parametrize("value", ["", "../x", "a/b", "-a", "a b", "a\nb", "é", "x" * (MAX_ID_CHARS + 1)])
def test_what_cannot_be_an_id_is_invalid_argument_naming_the_field(value):
    with pytest.raises(InvalidArgument) as refused:
        check_id("dst_instance_id", value)
    assert refused.value.message.startswith("dst_instance_id: ") and len(refused.value.message) < 200


def test_a_default_id_from_any_host_name_is_an_id():
    for host in ("web-1", "a b/c", "-odd", "x" * 300, "ünïcode"):
        assert id_problem(f"{host_word(host)}-50061") is None
    assert id_problem(default_id(50061)) is None
