"""A manager with a cluster token but no admin token warns that its admin API is the one left open."""

from __future__ import annotations

import pytest
import structlog

from services.common.tls import TlsConfig
from services.manager.app import warn_if_only_admin_api_open

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(("cluster_token", "admin_token", "warned"), [
    ("c" * 32, "", True), ("c" * 32, "a" * 32, False), ("", "", False), ("", "a" * 32, False)])
def test_only_a_cluster_token_without_an_admin_token_is_warned_about(cluster_token, admin_token, warned):
    with structlog.testing.capture_logs() as logs:
        warn_if_only_admin_api_open(TlsConfig(cluster_token=cluster_token), admin_token)
    assert [entry["event"] for entry in logs] == (["admin_api_open"] if warned else [])
    assert all(cluster_token not in str(entry) for entry in logs if cluster_token)
