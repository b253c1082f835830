"""services.common.log_sampling: first occurrence logged, then one line per interval per key with the
count held back since, a bounded key table (oldest dropped). An injected clock; no sleeps."""

from __future__ import annotations

import pytest

from services.common.log_sampling import LogSampler

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_occurrence_is_logged_then_one_line_per_interval_with_the_count_held_back():
    clock = Clock()
    sampler = LogSampler(interval_s=10, clock=clock)
    assert sampler.admit("k") == 0
    answers = []
    for _ in range(5):
        clock.now += 1
        answers.append(sampler.admit("k"))
    assert answers == [None] * 5
    clock.now = 110.0  # 10 s after the first line
    assert sampler.admit("k") == 5
    clock.now += 9.9
    assert sampler.admit("k") is None
    clock.now += 0.1
    assert sampler.admit("k") == 1
    clock.now += 60  # a quiet key: nothing held back
    assert sampler.admit("k") == 0


def test_keys_are_limited_apart():
    clock = Clock()
    sampler = LogSampler(interval_s=10, clock=clock)
    assert [sampler.admit(key) for key in ("a", "b", ("c", 401), ("c", 429))] == [0, 0, 0, 0]
    assert [sampler.admit(key) for key in ("a", "b", ("c", 401), ("c", 429))] == [None] * 4


def test_the_key_table_is_bounded_and_drops_the_key_logged_longest_ago():
    clock = Clock()
    sampler = LogSampler(interval_s=10, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        sampler.admit(key)
        clock.now += 1
    assert sampler.admit("a") is None  # held back, and still the one logged longest ago
    for n in range(100):
        sampler.admit(f"new-{n}")
    assert len(sampler) == 3
    assert sampler.admit("a") == 0  # forgotten: logged again as a first occurrence
    assert sampler.admit("new-99") is None  # one of the newest, kept


def test_a_zero_interval_logs_everything():
    sampler = LogSampler(interval_s=0, clock=Clock())
    assert [sampler.admit("k") for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("interval_s, max_keys", [(-1, 10), (10, 0)])
def test_nonsense_bounds_are_refused(interval_s, max_keys):
    with pytest.raises(ValueError):
        LogSampler(interval_s=interval_s, max_keys=max_keys)
