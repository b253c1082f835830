"""deploy/grafana/ferry-dashboard.json: valid, importable shape, and every metric it
queries is one a ferry service exports."""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ferry-dashboard.json"
_METRIC = re.compile(r"\b(ferry_[a-z_]+?)(?:_bucket|_count|_sum)?\b")

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def queried_metrics() -> set[str]:
    """The metric names the dashboard's queries use (histograms without their _bucket suffix)."""
    return {m for expr in queries() for m in _METRIC.findall(expr)}


def test_shape():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
    for panel in board["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel.get("targets", []))


def test_covers_load_migrations_downtime_and_latency():
    titles = " ".join(p["title"] for p in dashboard()["panels"]).lower()
    for topic in ("per instance", "migrations", "downtime", "ttft", "itl", "tokens per second"):
        assert topic in titles


def test_every_metric_is_exported_or_pending():
    source = "\n".join(p.read_text() for p in (ROOT / "services").rglob("*.py"))
    queried = queried_metrics()
    # a collector's counter family is named without the _total that Prometheus' exposition adds
    unknown = {m for m in queried if f'"{m}"' not in source and f'"{m.removesuffix("_total")}"' not in source}
    assert not unknown, f"the dashboard queries metrics no service exports: {sorted(unknown)}"


def test_request_rates_leave_out_probes_and_scrapes():
    """ferry_frontend_requests_total counts /health and /metrics too: compose's health check and
    Prometheus' scrapes made an idle cluster show requests per second (found by an operator's review)."""
    rates = [expr for expr in queries() if "ferry_frontend_requests_total" in expr]
    assert rates and all('endpoint=~"/v1/.*"' in expr for expr in rates), rates
