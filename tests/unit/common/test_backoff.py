"""Backoff: doubling delays with jitter, capped; `up_to` stays valid for caps below its start."""

from __future__ import annotations

import pytest

from services.common.backoff import Backoff


def test_delays_double_up_to_the_cap_and_reset():
    backoff = Backoff(initial_s=0.1, max_s=0.5, jitter=0.0)
    assert [backoff.next_delay() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert backoff.num_attempts == 5
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1) and backoff.num_attempts == 1


def test_jitter_never_exceeds_the_cap():
    backoff = Backoff(initial_s=1.0, max_s=1.0, jitter=0.5)
    assert all(0.5 <= backoff.next_delay() <= 1.0 for _ in range(200))


@pytest.mark.parametrize("cap_s", [0.01, 0.05, 0.1, 3.0])
def test_up_to_accepts_caps_below_the_usual_start(cap_s):
    """A registry with a 0.15 s lease TTL caps its keepalive retries at 0.05 s."""
    backoff = Backoff.up_to(cap_s)
    assert backoff.initial_s == min(0.1, cap_s) and backoff.max_s == cap_s
    assert 0 < backoff.next_delay() <= cap_s


def test_an_inverted_range_is_refused():
    with pytest.raises(ValueError, match="0 < initial_s <= max_s"):
        Backoff(initial_s=0.2, max_s=0.1)
