"""PrefixIndex: bounded LRU of chunk key -> instances, leading-match counts."""

from __future__ import annotations

import pytest

from services.manager.domain import InstanceId
from services.manager.prefix_index import MAX_HOLDERS, PrefixIndex

pytestmark = pytest.mark.timeout(10)
A, B, C = InstanceId("a"), InstanceId("b"), InstanceId("c")


def test_holders_are_newest_first_without_repeats_and_bounded():
    index = PrefixIndex()
    for instance_id in ["a", "b", "a", "c", "d", "e"]:
        index.record([7], InstanceId(instance_id))
    assert index.holders(7) == ("e", "d", "c", "a")[:MAX_HOLDERS]
    assert index.holders(8) == ()


def test_matches_count_leading_keys_only():
    index = PrefixIndex()
    index.record([1, 2, 3], A)
    index.record([1, 5], B)
    index.record([5], A)
    assert index.num_matched([1, 2, 3, 4], [A, B, C]) == {A: 3, B: 1, C: 0}
    assert index.num_matched([1, 7, 5], [A, B]) == {A: 1, B: 1}  # a holds 5, but 7 broke its prefix
    assert index.num_matched([9, 1], [A, B]) == {A: 0, B: 0}
    assert index.num_matched([], [A]) == {A: 0}


def test_the_bound_evicts_the_least_recently_recorded_keys_tails_first():
    index = PrefixIndex(max_keys=3)
    index.record([1, 2], A)
    index.record([3, 4], B)  # 4 keys: the oldest goes, and of [1, 2] that is the tail 2
    assert len(index) == 3
    assert (index.holders(1), index.holders(2)) == ((A,), ())
    index.record([1], C)  # touching 1 makes it recent again
    index.record([5], C)
    assert index.holders(1) == (C, A) and index.holders(4) == ()
    with pytest.raises(ValueError, match="max_keys"):
        PrefixIndex(max_keys=0)
