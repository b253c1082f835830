"""Shared fixtures for integration tests: one real etcd per test module."""

from __future__ import annotations

import uuid

import pytest

from services.common.etcd_launcher import LocalEtcd


@pytest.fixture(scope="module")
def etcd():
    """A real etcd on free loopback ports for this module; paused/stopped ones are brought back."""
    with LocalEtcd() as local_etcd:
        yield local_etcd


@pytest.fixture
def cluster() -> str:
    """A fresh cluster name, so tests sharing the module's etcd never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def running_etcd(etcd: LocalEtcd):
    """The module's etcd, made sure to be running and unpaused after the test."""
    yield etcd
    etcd.resume()
    if not etcd.is_running:
        etcd.start()
