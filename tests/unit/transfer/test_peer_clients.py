"""TransferClients, the sender's cached client per peer transfer service: a peer that restarts comes
back under a new address (the default port is 0), and each old address kept its gRPC channel for
good (found by a code review). Now a client neither taken nor called for `idle_close_s` is closed
when a new address is taken, never one with a call under way. No sockets: nothing is dialled."""

from __future__ import annotations

import asyncio

import pytest

from services.transfer.client import TransferClient, TransferClients

pytestmark = pytest.mark.timeout(10)

IDLE_S = 600.0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def closed(monkeypatch) -> list[str]:
    """The addresses whose clients were closed, in order."""
    addresses: list[str] = []
    real_close = TransferClient.close

    async def close(client: TransferClient) -> None:
        addresses.append(client.address)
        await real_close(client)
    monkeypatch.setattr(TransferClient, "close", close)
    return addresses


async def test_a_client_idle_that_long_is_closed_when_a_new_peer_is_taken(closed):
    clock = Clock()
    clients = TransferClients(idle_close_s=IDLE_S, clock=clock)
    first = clients("127.0.0.1:1001")
    assert clients("127.0.0.1:1001") is first  # cached
    clock.now += IDLE_S - 1
    clients("127.0.0.1:1001")  # taken again: its idle time starts over
    clock.now += IDLE_S - 1
    clients("127.0.0.1:1002")
    assert clients.addresses == ["127.0.0.1:1001", "127.0.0.1:1002"]
    clock.now += IDLE_S
    clients("127.0.0.1:1003")
    await asyncio.sleep(0.05)
    assert clients.addresses == ["127.0.0.1:1003"] and closed == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert clients("127.0.0.1:1001") is not first  # a peer back on an old address gets a fresh client
    await clients.close()


async def test_a_client_with_a_call_under_way_is_never_closed(closed):
    clock = Clock()
    clients = TransferClients(idle_close_s=IDLE_S, clock=clock)
    busy = clients("127.0.0.1:1001")
    answer = asyncio.Event()

    async def get_status(request, timeout, metadata):  # a call the peer takes long to answer
        await answer.wait()
        return "status"
    busy._stub.GetStatus = get_status
    call = asyncio.create_task(busy.get_status())
    await asyncio.sleep(0.01)
    clock.now += 10 * IDLE_S
    clients("127.0.0.1:1002")
    await asyncio.sleep(0.05)
    assert "127.0.0.1:1001" in clients.addresses and not closed
    answer.set()
    assert await call == "status"
    clock.now += IDLE_S - 1  # idle from when its call ended
    clients("127.0.0.1:1003")
    assert "127.0.0.1:1001" in clients.addresses
    clock.now += 1
    clients("127.0.0.1:1004")
    await asyncio.sleep(0.05)
    assert "127.0.0.1:1001" not in clients.addresses and "127.0.0.1:1001" in closed
    await clients.close()
    assert sorted(closed) == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003", "127.0.0.1:1004"]
