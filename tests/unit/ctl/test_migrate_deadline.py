"""ferryctl migrate waits for the manager's worst case: the leader's (services/manager/server.py
leader_migrate_time_s) plus a standby's forwarding, at the manager's defaults; past its deadline it
says which flag waits longer, since a manager run with a larger --migration-timeout-s takes longer."""

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
