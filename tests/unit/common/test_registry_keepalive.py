"""The registry's keepalive loop outlives any error from one renewal, and still counts them toward the TTL."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.common.errors import Internal
from services.common.registry import Registry
from tests.unit.loop_checks import FakeLease, assert_cancels, until

pytestmark = pytest.mark.timeout(30)  # 10 s: one test took 4.9 s of it at load 20, two workers

TTL_S = 0.6  # renewals every 0.2 s; the keepalive backoff starts at 0.1 s


class FakeKv:
    def __init__(self) -> None:
        self.puts: list[tuple[str, int]] = []

    async def put(self, key, value, lease=None, timeout=None) -> None:
        self.puts.append((key, lease))

    async def txn(self, compare, success, failure=(), timeout=None):
        """The keepalive's read-back of our keys: each still under the lease."""
        held = SimpleNamespace(kvs=[SimpleNamespace(lease=FakeLease.lease_id, value=b"{}")])
        return SimpleNamespace(succeeded=True, responses=[SimpleNamespace(response_range=held) for _ in success])


class FakeEtcd:
    def __init__(self) -> None:
        self.kv = FakeKv()


def registered(lease: FakeLease) -> Registry:
    """A registry holding one entry under `lease`, as register() leaves it (without etcd)."""
    registry = Registry(["127.0.0.1:1"], "test", ttl_s=TTL_S)
    registry._client = FakeEtcd()
    registry._lease = lease
    registry._entries[registry.key("instances", "i-1")] = {"address": "127.0.0.1:2"}
    registry._renewed_at = time.monotonic()
    registry._lease_valid_until = registry._renewed_at + TTL_S
    registry._set_registered(True)
    return registry


async def test_unexpected_renewal_errors_do_not_end_the_loop():
    lease = FakeLease(RuntimeError("boom"), Internal("boom"))
    registry = registered(lease)
    loop = asyncio.create_task(registry._keepalive_loop())
    await until(lambda: lease.num_renewals >= 2, loop)
    assert registry.is_registered
    await assert_cancels(loop)


async def test_a_ttl_of_unexpected_errors_loses_the_registration_and_renewals_restore_it():
    lease = FakeLease()
    lease.error = RuntimeError("boom")
    registry = registered(lease)
    changes = []
    registry.on_registration_change(changes.append)
    loop = asyncio.create_task(registry._keepalive_loop())
    # Hang guards within the module's 30 s (a TTL of failures, 0.6 s, took over 3 s at load 12 on two cores).
    await until(lambda: changes == [False], loop, timeout_s=12.0)  # the loop's verdict (the clock's comes first)
    assert not registry.is_registered
    lease.error = None
    await until(lambda: registry.is_registered, loop, timeout_s=12.0)
    assert changes == [False, True]
    assert registry._client.kv.puts == [("/ferry/test/instances/i-1", FakeLease.lease_id)]
    assert registry.num_reregistrations == 1
    await assert_cancels(loop)
