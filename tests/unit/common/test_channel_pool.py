"""Pooled channels: one per address, closed once idle for a while, never under a call."""

from __future__ import annotations

import grpc
import pytest

from services.common.channel_pool import ChannelPool

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_one_channel_per_address_while_it_is_used():
    pool = ChannelPool(idle_close_s=60.0, clock=Clock())
    async with pool.use("127.0.0.1:1") as first, pool.use("127.0.0.1:1") as again:
        assert first is again
    assert pool.addresses == ["127.0.0.1:1"]
    await pool.close()
    assert pool.addresses == []


async def test_an_idle_channel_closes_when_a_new_address_is_dialled_and_a_busy_one_stays():
    clock = Clock()
    pool = ChannelPool(idle_close_s=60.0, clock=clock)
    async with pool.use("127.0.0.1:1") as idle:
        pass
    async with pool.use("127.0.0.1:2") as streaming:
        clock.now = 61.0
        async with pool.use("127.0.0.1:3"):
            assert pool.addresses == ["127.0.0.1:2", "127.0.0.1:3"]  # :2 has a call on it: kept
        assert streaming.get_state() is not grpc.ChannelConnectivity.SHUTDOWN
    assert idle.get_state() is grpc.ChannelConnectivity.SHUTDOWN
    clock.now = 90.0
    async with pool.use("127.0.0.1:4"):  # :2 and :3 ended their calls under 60 s ago
        assert pool.addresses == ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"]
    await pool.close()
