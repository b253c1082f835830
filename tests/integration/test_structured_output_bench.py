"""The structured output benchmark in its smallest form: a tiny model, both runs decode every
token, and the figures it prints."""

from __future__ import annotations

import re

import pytest

from tests.integration.benchmark_run import run_benchmark


@pytest.mark.timeout(200)
def test_prints_free_and_guided_step_times_over_the_same_tokens():
    lines = run_benchmark("structured_output.py", "--tiny", "--threads", "1", "--batch", "3",
                          "--output-len", "12", "--fields", "4", timeout_s=180)
    assert "tokens generated\tfree 36\tguided 36" in lines
    assert re.search(r"decode step ms \(median\)\tfree [\d.]+\tguided [\d.]+\tguided/free [\d.]+x", "\n".join(lines))
    assert re.search(r"grammar work per request and token \(mask \+ accept, mean\)\t\d+ us", "\n".join(lines))
