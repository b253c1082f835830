"""Read samples from a service's Prometheus /metrics endpoint, and check its text as Prometheus would."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def sample_value(port: int, sample: str) -> float:
    """The value of `sample` (a metric name with its labels, as exported), 0 if it is absent."""
    return samples(port).get(sample, 0.0)


def samples(port: int) -> dict[str, float]:
    """Every exported sample (a metric name with its labels) → its value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)}


def exposition_problems(text: str) -> list[str]:
    """What an operator's Prometheus would trip over in one /metrics text: a series exported twice,
    a ferry family without HELP or TYPE, a counter not named *_total, a histogram whose buckets are
    not cumulative or do not end at +Inf = _count, a request id as a label (one series per request)."""
    problems = _duplicate_series(text)
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    typed = set(types)
    problems += [f"{name} is a counter not named *_total" for name, kind in types.items()
                 if kind == "counter" and name.startswith("ferry_") and not name.endswith("_total")]
    for family in text_string_to_metric_families(text):  # raises on text Prometheus cannot parse
        if not family.name.startswith("ferry_"):
            continue
        if not family.documentation:
            problems.append(f"{family.name} has no HELP")
        if family.name not in typed and f"{family.name}_total" not in typed:
            problems.append(f"{family.name} has no TYPE (Prometheus reads it as untyped)")
        problems += [f"{family.name} is labelled by {label}" for sample in family.samples
                     for label in sample.labels if label in _PER_REQUEST_LABELS]
        if family.type == "histogram":
            problems += _histogram_problems(family)
    return problems


def _duplicate_series(text: str) -> list[str]:
    """A series (name and labels) exported twice: Prometheus rejects the whole scrape."""
    series = [line.rpartition(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    return [f"{name} is exported twice" for name in sorted({s for s in series if series.count(s) > 1})]


_PER_REQUEST_LABELS = frozenset({"request_id", "client_request_id", "migration_id"})


def _histogram_problems(family) -> list[str]:
    buckets: dict[tuple, list[tuple[float, float]]] = {}
    counts: dict[tuple, float] = {}
    for sample in family.samples:
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        if sample.name.endswith("_bucket"):
            buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_count"):
            counts[key] = sample.value
    problems = []
    for key, count in counts.items():
        series = sorted(buckets.get(key, []))
        values = [value for _, value in series]
        if not series or series[-1][0] != math.inf or values[-1] != count:
            problems.append(f"{family.name}{dict(key)} does not end with le=+Inf equal to its _count")
        if values != sorted(values):
            problems.append(f"{family.name}{dict(key)} has buckets that are not cumulative")
    return problems
