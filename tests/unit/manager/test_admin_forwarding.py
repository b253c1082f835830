"""A standby manager forwards admin calls to the leader over one client; a leader change must not
cut calls still running on the former leader's client (a forwarded Migrate runs for seconds)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.manager.cluster_view import ClusterView
from services.manager.leadership import Leader, Leadership
from services.manager.server import AdminServicer
from tests.unit.manager.factories import FakeClock

pytestmark = pytest.mark.timeout(20)


class SlowLeader(manager_pb2_grpc.AdminServiceServicer):
    def __init__(self) -> None:
        self.migrating = asyncio.Event()

    async def Migrate(self, request, context):
        self.migrating.set()
        await asyncio.sleep(1.0)  # a live migration takes a while
        return manager_pb2.MigrateResponse(request_id="r-1", src_instance_id="a", dst_instance_id="b")

    async def ListInstances(self, request, context):
        return manager_pb2.ListInstancesResponse()


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    manager_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class NoMetadata:
    def invocation_metadata(self):
        return ()


async def test_a_leader_change_does_not_cut_a_forwarded_migrate_in_flight():
    old, new = SlowLeader(), SlowLeader()
    (old_server, old_address), (new_server, new_address) = await serve(old), await serve(new)
    leadership = Leadership("standby", "127.0.0.1:1")  # not elected
    leadership.set_watched_leader(Leader("m-old", old_address))
    admin = AdminServicer(ClusterView(report_timeout_s=3.0, clock=FakeClock()), None, leadership, None, None, None,
                          None, list_requests_timeout_s=1.0, forward_timeout_s=1.0, migrate_timeout_s=5.0)
    try:
        migrate = asyncio.create_task(admin.Migrate(manager_pb2.MigrateRequest(request_id="r-1"), NoMetadata()))
        await asyncio.wait_for(old.migrating.wait(), 5)
        leadership.set_watched_leader(Leader("m-new", new_address))  # the old leader resigned meanwhile
        await admin.ListInstances(manager_pb2.ListInstancesRequest(), NoMetadata())  # e.g. `ferryctl top`
        assert (await migrate).request_id == "r-1"
    finally:
        await admin.close()
        await old_server.stop(0)
        await new_server.stop(0)
