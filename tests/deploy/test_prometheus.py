"""deploy/prometheus.yml scrapes every process of deploy/docker-compose.yml that serves
/metrics, at the port it serves it on (before, no scrape configuration shipped with the
dashboard, and an operator had to work the targets out from the compose file)."""

from __future__ import annotations

import pathlib

import pytest
import yaml

pytestmark = pytest.mark.timeout(10)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def metrics_endpoints() -> set[str]:
    """host:port of each compose service's /metrics: its *_METRICS_PORT, or the frontend's HTTP port."""
    services = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())["services"]
    endpoints = set()
    for name, service in services.items():
        env = service.get("environment") or {}
        port = next((v for k, v in env.items() if k.endswith("_METRICS_PORT")), env.get("FERRY_FRONTEND_PORT"))
        if port:
            endpoints.add(f"{name}:{port}")
    return endpoints


def test_every_metrics_endpoint_of_compose_is_scraped():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert len(targets) == len(set(targets))
    assert set(targets) == metrics_endpoints() | {"etcd:2379"}  # etcd serves /metrics on its client port
    assert {"frontend:8000", "manager-0:9100", "manager-1:9100", "instance-1:9100"} <= set(targets)
