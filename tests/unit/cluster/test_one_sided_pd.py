"""`up` with prefill instances and none that decode (or the reverse) starts, and says what that means."""

from __future__ import annotations

import pytest

from services.cluster.__main__ import one_sided_pd, parse_args

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("flags, says", [
    (["--prefill-instances", "1"], "decodes on the prefill instance"),
    (["--prefill-instances", "2", "--instances", "0"], "decodes on the prefill instance"),
    (["--decode-instances", "1"], "prefilled on a decode instance"),
])
def test_a_one_sided_pd_cluster_is_named(flags, says):
    assert says in one_sided_pd(parse_args(["up", *flags]))


@pytest.mark.parametrize("flags", [
    [], ["--instances", "3"], ["--prefill-instances", "1", "--decode-instances", "2"],
    ["--prefill-instances", "1", "--instances", "1"], ["--decode-instances", "1", "--instances", "1"],
])
def test_a_cluster_with_both_kinds_is_not(flags):
    assert one_sided_pd(parse_args(["up", *flags])) is None
