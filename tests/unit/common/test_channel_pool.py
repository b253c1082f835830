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


async def test_spellings_of_one_address_share_its_channel():
    # An instance named by its etcd record (127.0.0.1:P) and by a caller (localhost:P) had two channels.
    pool = ChannelPool(idle_close_s=60.0, clock=Clock())
    async with pool.use("localhost:1") as first, pool.use("127.0.0.1:1") as again, pool.use("LocalHost.:01") as third:
        assert first is again is third
    async with pool.use("[::1]:2") as first, pool.use("[0:0::1]:2") as again:
        assert first is again
    assert len(pool.addresses) == 2
    await pool.close()


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


async def test_a_peer_restarted_on_its_port_is_reached_at_once_not_after_the_reconnect_backoff():
    # A restarted instance was refused for 1-2 s after it served: the pooled channel sat in reconnect
    # backoff and failed calls with its cached "Connection refused" (found by a fault run).
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from services.common.etcd_launcher import free_port

    port = free_port()

    async def serve() -> grpc.aio.Server:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    async def check(pool: ChannelPool) -> None:
        async with pool.use(f"127.0.0.1:{port}") as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)

    pool = ChannelPool()
    server = await serve()
    await check(pool)
    await server.stop(0)  # the peer dies; calls meanwhile fail and the channel backs off
    for _ in range(4):
        with pytest.raises(grpc.aio.AioRpcError):
            await check(pool)
    server = await serve()  # the peer is back on the same port
    try:
        await check(pool)
    finally:
        await server.stop(0)
        await pool.close()


async def test_a_replaced_channel_still_in_use_is_closed_by_close():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.etcd_launcher import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens
    pool = ChannelPool()
    async with pool.use(address) as old:  # a call still runs on it (say, a stream)
        with pytest.raises(grpc.aio.AioRpcError):
            await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert old.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
        async with pool.use(address) as fresh:
            assert fresh is not old
        await pool.close()
        assert old.get_state() is grpc.ChannelConnectivity.SHUTDOWN
        assert fresh.get_state() is grpc.ChannelConnectivity.SHUTDOWN
