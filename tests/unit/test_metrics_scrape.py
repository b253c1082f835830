"""The /metrics checks the e2e and unit metric tests rely on find what Prometheus would trip over."""

from __future__ import annotations

import pytest

from tests.integration.metrics_scrape import exposition_problems

pytestmark = pytest.mark.timeout(10)

GOOD = """# HELP ferry_x_total Things
# TYPE ferry_x_total counter
ferry_x_total{kind="a"} 1.0
# HELP ferry_y Level
# TYPE ferry_y gauge
ferry_y 2.0
"""


def test_a_clean_text_has_no_problems():
    assert exposition_problems(GOOD) == []


def test_a_series_exported_twice_and_an_untyped_family_are_found():
    text = GOOD + 'ferry_x_total{kind="a"} 2.0\n# HELP ferry_z Untyped\nferry_z 1.0\n'
    problems = exposition_problems(text)
    assert 'ferry_x_total{kind="a"} is exported twice' in problems
    assert "ferry_z has no TYPE (Prometheus reads it as untyped)" in problems


def test_a_counter_not_named_total_is_found():
    text = GOOD + "# HELP ferry_w Counted\n# TYPE ferry_w counter\nferry_w 1.0\n"
    assert "ferry_w is a counter not named *_total" in exposition_problems(text)
