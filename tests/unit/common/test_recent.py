"""Recent: items kept for a while and up to a count, the oldest going first."""

from __future__ import annotations

import time

import pytest

from services.common.recent import Recent

pytestmark = pytest.mark.timeout(10)


def test_items_go_when_too_old_or_too_many_the_oldest_first():
    recent: Recent[str, int] = Recent(max_age_s=0.2, max_items=2)
    for i, key in enumerate(("a", "b", "c")):
        recent.note(key, i)
    assert recent.get("a") is None and recent.get("b") == 1 and recent.get("c") == 2
    recent.note("b", 10)  # noted again: now the newest
    recent.note("d", 3)
    assert recent.get("c") is None and recent.get("b") == 10
    recent.forget("b")
    assert recent.get("b") is None and recent.get("d") == 3
    time.sleep(0.25)
    assert recent.get("d") is None
