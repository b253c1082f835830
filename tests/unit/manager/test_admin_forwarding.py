"""A standby manager forwards admin calls to the leader over one client; a leader change must not
cut calls still running on the former leader's client (a forwarded Migrate runs for seconds)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import instance_pb2, manager_pb2, manager_pb2_grpc
from services.manager.cluster_view import ClusterView
from services.manager.leadership import Leader, Leadership
from services.manager.migration_settle import HeldRequest, RequestOrigin
from services.manager.migrator import Migrator, MigratorLimits
from services.manager.server import AdminServicer
from tests.unit.manager.factories import FakeClock, make_view

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


class SlowInstances:
    """InstanceChannels: each ListRequests answers near its deadline; request r-1 runs on instance a."""

    async def list_requests(self, address, timeout_s):
        await asyncio.sleep(timeout_s * 0.9)
        return [instance_pb2.RequestInfo(request_id="r-1", instance_id="a", state="running")]


class UnansweredSource:
    """MigrateOutClient: the source gives no answer in time, yet the destination holds the request (it committed)."""

    async def migrate_out(self, order, timeout_s, on_picked):
        await asyncio.sleep(timeout_s)
        raise Unavailable("the source did not answer in time")

    async def held_request(self, address, request_id, timeout_s):
        await asyncio.sleep(timeout_s * 0.9)
        return HeldRequest(RequestOrigin.MIGRATED_IN, "a")


async def test_a_forwarded_migrate_waits_as_long_as_the_leaders_slowest_migrate():
    """The leader finds the request (a ListRequests fan-out), its source does not answer until the MigrateOut
    deadline, and the destination then says it committed: the standby's caller gets that answer, not a timeout."""
    timeouts = {"list_requests_timeout_s": 0.3, "forward_timeout_s": 0.2, "migrate_timeout_s": 0.5}
    view = make_view("a", "b")
    leading = Leadership("leader", "127.0.0.1:1")
    leading.set_elected(True)
    migrator = Migrator(view, leading, UnansweredSource(), MigratorLimits(timeout_s=timeouts["migrate_timeout_s"]))
    leader = AdminServicer(view, None, leading, None, SlowInstances(), migrator, None, **timeouts)
    server, address = await serve(leader)
    standby = Leadership("standby", "127.0.0.1:2")
    standby.set_watched_leader(Leader("leader", address))
    admin = AdminServicer(ClusterView(report_timeout_s=3.0, clock=FakeClock()), None, standby, None, None, None,
                          None, **timeouts)
    try:
        reply = await admin.Migrate(manager_pb2.MigrateRequest(request_id="r-1"), NoMetadata())
        assert (reply.request_id, reply.src_instance_id, reply.dst_instance_id) == ("r-1", "a", "b")
    finally:
        await admin.close()
        await migrator.close()
        await server.stop(0)


class HangingClose:
    """A retired client whose close() waits on a future nothing else references (as a channel's may)."""

    def __init__(self) -> None:
        self.waiting: weakref.ref | None = None
        self.is_closed = False

    async def close(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self.waiting = weakref.ref(future)
        await future
        self.is_closed = True


async def poll(is_done, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not is_done():
            await asyncio.sleep(0.01)


async def test_a_retired_clients_close_runs_to_its_end_through_a_garbage_collection():
    """asyncio keeps only weak references to tasks: the task closing a former leader's client is kept by us."""
    admin = AdminServicer(ClusterView(report_timeout_s=3.0, clock=FakeClock()), None, Leadership("standby", "x:1"),
                          None, None, None, None, list_requests_timeout_s=0.01, forward_timeout_s=0.01,
                          migrate_timeout_s=0.01)
    client = HangingClose()
    admin._retire(client)
    await poll(lambda: client.waiting is not None)
    gc.collect()
    future = client.waiting()
    assert future is not None, "the task closing the retired client was collected mid-way"
    future.set_result(None)
    await poll(lambda: client.is_closed)
    await admin.close()
