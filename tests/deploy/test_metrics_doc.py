"""README's "Metrics reference" names every metric the services define (before, about half
of them, the instance gauges and the manager's dispatch metrics among them, were documented
nowhere)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(10)

ROOT = pathlib.Path(__file__).resolve().parents[2]
_DEFINED = re.compile(r'"(ferry_(?:frontend|manager|instance|transfer)_[a-z0-9_]+)"')


def reference() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("### Metrics reference"):]


def test_every_defined_metric_is_in_the_reference():
    defined = {m for path in (ROOT / "services").glob("*/metrics.py") for m in _DEFINED.findall(path.read_text())}
    assert len(defined) > 40
    table = reference()
    # a collector's counter family is named without the _total that the exposition adds
    missing = {m for m in defined if f"`{m}`" not in table and f"`{m}_total`" not in table}
    assert not missing, f"README's Metrics reference does not name {sorted(missing)}"
