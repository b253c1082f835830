"""ferryctl migrate waits for the manager's worst case: what the manager says (GetClusterStatusResponse.
migrate_time_s: the leader's services/manager/server.py leader_migrate_time_s plus a standby's forwarding) and a
margin; for an older manager, which does not say, that at the manager's defaults; past its deadline it says
which flag waits longer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.ctl import client as ctl_client
from services.ctl.client import AdminClient
from services.manager.config import ManagerConfig
from services.manager.server import leader_migrate_time_s

pytestmark = pytest.mark.timeout(20)


def test_the_migrate_deadline_covers_the_managers_default_worst_case():
    defaults = ManagerConfig()
    forwarded = (leader_migrate_time_s(defaults.migration_timeout_s, defaults.list_requests_timeout_s)
                 + defaults.admin_forward_timeout_s)
    assert ctl_client.MIGRATE_TIMEOUT_S > forwarded


class NeverDone(manager_pb2_grpc.AdminServiceServicer):
    async def Migrate(self, request, context):
        await asyncio.sleep(10)  # a manager whose --migration-timeout-s is longer than ferryctl waits
        return manager_pb2.MigrateResponse()


async def test_a_migrate_past_the_deadline_names_the_flag_that_waits_longer(monkeypatch):
    monkeypatch.setattr(ctl_client, "MIGRATE_TIMEOUT_S", 0.3)
    server = grpc.aio.server()
    manager_pb2_grpc.add_AdminServiceServicer_to_server(NeverDone(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AdminClient(f"127.0.0.1:{port}", timeout_s=0.1) as client:
            with pytest.raises(Unavailable) as raised:
                await client.migrate(src_instance_id="a")
    finally:
        await server.stop(None)
    assert "stopped waiting after 0.3 s" in raised.value.message
    assert "--timeout-s" in raised.value.message and "ferryctl migrations" in raised.value.message


class SaysItsMigrateTime(manager_pb2_grpc.AdminServiceServicer):
    def __init__(self, migrate_time_s: float, takes_s: float) -> None:
        self.migrate_time_s = migrate_time_s
        self.takes_s = takes_s

    async def GetClusterStatus(self, request, context):
        return manager_pb2.GetClusterStatusResponse(migrate_time_s=self.migrate_time_s)

    async def Migrate(self, request, context):
        await asyncio.sleep(self.takes_s)
        return manager_pb2.MigrateResponse(request_id="r-1")


async def _migrate_on(servicer: manager_pb2_grpc.AdminServiceServicer) -> manager_pb2.MigrateResponse:
    server = grpc.aio.server()
    manager_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AdminClient(f"127.0.0.1:{port}", timeout_s=0.1) as client:
            return await client.migrate(src_instance_id="a")
    finally:
        await server.stop(None)


async def test_a_migrate_waits_as_long_as_the_manager_says_its_migrate_takes(monkeypatch):
    """A manager run with a longer --migration-timeout-s: ferryctl gave up at 75 s whatever it said."""
    monkeypatch.setattr(ctl_client, "MIGRATE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ctl_client, "MIGRATE_MARGIN_S", 0.3)
    assert (await _migrate_on(SaysItsMigrateTime(migrate_time_s=0.8, takes_s=0.7))).request_id == "r-1"
    with pytest.raises(Unavailable) as raised:
        await _migrate_on(SaysItsMigrateTime(migrate_time_s=0.2, takes_s=10))
    assert "stopped waiting after 0.5 s" in raised.value.message
    assert "the manager's Migrate takes up to 0.2 s" in raised.value.message
