"""The frontend's manager client follows the leader with one channel at a time."""

from __future__ import annotations

import asyncio
import socket

import pytest
from structlog.testing import capture_logs

from services.common.etcd_launcher import free_port
from services.frontend import manager_client
from services.frontend.manager_client import ManagerClient
from tests.unit.frontend.factories import make_spec

pytestmark = pytest.mark.timeout(30)


class MovingLeader:
    def __init__(self, address: str) -> None:
        self.address = address

    def leader_address(self) -> str | None:
        return self.address


async def test_a_leader_change_falls_back_for_the_dispatch_in_flight_and_opens_one_channel(monkeypatch):
    opened = []
    open_channel = manager_client.secure_or_insecure_channel
    monkeypatch.setattr(manager_client, "secure_or_insecure_channel",
                        lambda address, tls: opened.append(open_channel(address, tls)) or opened[-1])
    with socket.socket() as silent:  # a leader that takes the connection and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        leader = MovingLeader(f"127.0.0.1:{silent.getsockname()[1]}")
        client = ManagerClient(leader, timeout_s=2.0)
        waiting = asyncio.create_task(client.dispatch(make_spec(), []))  # in flight on the old channel
        await asyncio.sleep(0.2)
        leader.address = f"127.0.0.1:{free_port()}"  # the leader moved: closing the old channel takes a while
        answers = await asyncio.gather(*(client.dispatch(make_spec(), []) for _ in range(3)))
        assert answers == [None, None, None] and await waiting is None  # each falls back
    assert len(opened) == 2, f"{len(opened) - 1} channels opened for one leader change"
    await client.close()


async def test_a_flood_of_failed_dispatches_logs_one_line_per_address_and_code():
    """Before, each dispatch a down manager failed logged manager_dispatch_failed: one line per request."""
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nothing listens there
    leader = MovingLeader(first)
    client = ManagerClient(leader, timeout_s=2.0)
    with capture_logs() as logs:
        for _ in range(20):
            assert await client.dispatch(make_spec(), []) is None
        leader.address = second  # another manager: its own line
        assert await client.dispatch(make_spec(), []) is None
    await client.close()
    lines = [(e["address"], e["code"], e["suppressed"]) for e in logs if e["event"] == "manager_dispatch_failed"]
    assert lines == [(first, "UNAVAILABLE", 0), (second, "UNAVAILABLE", 0)]
