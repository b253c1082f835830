"""The manager as a real process against a real etcd: dispatch, admin API, persistence, failover.

Instances are simulated from the test (etcd record + ReportLoad stream + a fake
InstanceService where ListRequests is needed); the manager's sockets and etcd use are real.
Each test uses its own cluster name (conftest's `cluster`), so tests share the module's etcd.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time

import pytest
from etcd3aio import Etcd3Client
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.common.gen.ferry.v1 import common_pb2
from services.ctl.client import AdminClient
from services.common.grpc_server import insecure_channel
from services.common.prefix_hash import MAX_PREFIX_CHUNKS, prefix_chunk_keys
from services.manager.client import ManagerClient
from services.manager.cluster_view import IN_TRANSIT_S
from tests.integration.manager_harness import (
    SimulatedInstance, leader_of, serving_instance, start_manager, wait_until,
)

pytestmark = pytest.mark.timeout(90)

LEASE_TTL_S = 2.0
REPORT_TIMEOUT_S = 1.0


@pytest.fixture
async def etcd_client(etcd):
    client = Etcd3Client([etcd.endpoint])
    await client.connect()
    yield client
    await client.close()


@pytest.fixture
async def managers(etcd, cluster, tmp_path):
    """start(manager_id) → a running ManagerProcess; all are stopped at the end."""
    started = []

    async def start(manager_id: str, *args: str):
        manager = await start_manager(etcd.endpoint, cluster, manager_id, tmp_path, "--lease-ttl-s", str(LEASE_TTL_S),
                                      "--report-timeout-s", str(REPORT_TIMEOUT_S), *args)
        started.append(manager)
        return manager

    yield start
    for manager in started:
        await manager.stop()


@pytest.fixture
async def instances(etcd_client, cluster):
    """add(instance, addresses) → registered in etcd, reporting to the leader among `addresses()`."""
    added = []

    async def add(instance: SimulatedInstance, manager_addresses):
        await instance.register(etcd_client, cluster)
        instance.start_reporting(manager_addresses)
        added.append(instance)
        return instance

    yield add
    for instance in added:
        await instance.stop()


async def lead(manager) -> None:
    async def is_leader():
        return await leader_of(manager) == manager.manager_id
    await wait_until(is_leader, 10, f"{manager.manager_id} leading")


async def wait_reported(client: ManagerClient, *instance_ids: str) -> None:
    async def all_reported():
        infos = {i.instance_id: i for i in await client.list_instances()}
        return all(i in infos and infos[i].report_age_s >= 0 for i in instance_ids)
    await wait_until(all_reported, 10, f"{instance_ids} reported")


async def state_of(client: ManagerClient, instance_id: str) -> int:
    return {i.instance_id: i.state for i in await client.list_instances()}[instance_id]


async def test_dispatch_spreads_a_burst_and_avoids_a_full_instance(managers, instances):
    manager = await managers("m-a", "--report-timeout-s", "60")
    await lead(manager)
    to_manager = lambda: [manager.address]  # noqa: E731
    fakes = [await instances(SimulatedInstance(f"i-{n}", f"127.0.0.1:{9100 + n}"), to_manager) for n in range(3)]
    fakes.append(await instances(SimulatedInstance("i-full", "127.0.0.1:9199", num_free_blocks=0, num_running=8),
                                 to_manager))
    async with ManagerClient(manager.address) as client:
        await wait_reported(client, "i-0", "i-1", "i-2", "i-full")
        # Then no report during the burst: a report replaces the reservations made half a second before
        # it, which a loaded machine's burst can outlast (the reports never count the burst's requests).
        # Reports go on until then: the manager drops one that comes before it saw the instance in etcd.
        for fake in fakes:
            fake.report_interval_s = 30.0
        await asyncio.sleep(0.3)  # a report already on its way lands before the burst
        placements = await asyncio.gather(*(client.dispatch(f"r-{n}", num_prompt_tokens=100) for n in range(30)))
        counts = collections.Counter(p.instance_id for p in placements)
        assert "i-full" not in counts
        assert sorted(counts) == ["i-0", "i-1", "i-2"] and max(counts.values()) - min(counts.values()) <= 2, counts
        assert {p.policy for p in placements} == {"load"}
        infos = {i.instance_id: i for i in await client.list_instances()}
        assert sum(i.num_dispatched for i in infos.values()) == 30
        assert (infos["i-0"].pid, infos["i-0"].host, infos["i-0"].model) == (4242, "sim-host", "sim")
        assert infos["i-0"].address == "127.0.0.1:9100" and infos["i-0"].role == common_pb2.ROLE_BOTH
        assert infos["i-full"].num_free_blocks == 0 and infos["i-full"].num_running == 8
        status = await client.get_cluster_status()
        assert (status.num_instances, status.num_serving, status.num_dispatched) == (4, 4, 30)
        assert (status.leader_id, status.leader_address, status.answered_by) == ("m-a", manager.address, "m-a")


async def test_exclude_drain_and_silence_keep_dispatch_away(managers, instances):
    manager = await managers("m-a")
    await lead(manager)
    to_manager = lambda: [manager.address]  # noqa: E731
    _, b, _ = [await instances(SimulatedInstance(f"i-{x}", f"127.0.0.1:{9200 + n}"), to_manager)
               for n, x in enumerate("abc")]
    async with ManagerClient(manager.address) as client:
        await wait_reported(client, "i-a", "i-b", "i-c")
        assert await client.set_policy("flood") == "flood"
        assert (await client.dispatch("r-1", 10)).instance_id == "i-a"
        assert (await client.dispatch("r-2", 10, exclude_instance_ids=["i-a"])).instance_id == "i-b"

        assert (await client.drain("i-a")).state == common_pb2.INSTANCE_STATE_DRAINING
        assert {(await client.dispatch(f"r-d{n}", 10)).instance_id for n in range(5)} == {"i-b"}
        with pytest.raises(NotFound, match="'i-zz' is not registered"):
            await client.drain("i-zz")
        for call in (client.drain, client.undrain):
            with pytest.raises(InvalidArgument, match="instance_id: required"):
                await call("")
        async with AdminClient(manager.address) as admin:
            with pytest.raises(InvalidArgument, match="instance_id: required"):
                await admin.set_role("", "both")

        b.is_reporting = False
        await wait_until(lambda: _has_state(client, "i-b", common_pb2.INSTANCE_STATE_UNHEALTHY), 5, "i-b unhealthy")
        assert (await client.dispatch("r-3", 10)).instance_id == "i-c"
        with pytest.raises(Unavailable, match=r"no serving instance .*1 draining.*1 excluded by the caller.*1 unhealthy"):
            await client.dispatch("r-4", 10, exclude_instance_ids=["i-c"])
        b.is_reporting = True
        await wait_until(lambda: _has_state(client, "i-b", common_pb2.INSTANCE_STATE_SERVING), 5, "i-b serving again")
        assert (await client.dispatch("r-5", 10)).instance_id == "i-b"

        assert (await client.undrain("i-a")).state == common_pb2.INSTANCE_STATE_SERVING
        assert (await client.dispatch("r-6", 10)).instance_id == "i-a"  # flood: the first serving instance again
        assert (await client.undrain("i-a")).state == common_pb2.INSTANCE_STATE_SERVING  # twice: no harm
        # An instance whose lease lapsed in its shutdown is absent with its self-drain mark for a moment, and puts
        # the mark back when it registers again: the error says nothing was undone, and when to ask again.
        with pytest.raises(NotFound, match="'i-zz' is not registered; it has no drain mark either: nothing was undone. .* "
                                           "undrain it once ListInstances lists it"):
            await client.undrain("i-zz")


REPORTER = """
import sys, time
import grpc
from services.common.gen.ferry.v1 import common_pb2, manager_pb2_grpc
def reports():
    while True:
        yield common_pb2.LoadReport(instance_id=sys.argv[2], num_free_blocks=1000, num_total_blocks=1000)
        time.sleep(0.05)
with grpc.insecure_channel(sys.argv[1]) as channel:
    manager_pb2_grpc.ManagerServiceStub(channel).ReportLoad(reports())
"""


async def test_an_instance_killed_is_unhealthy_at_once_not_after_the_report_timeout(managers, etcd_client,
                                                                                     cluster):
    manager = await managers("m-a", "--report-timeout-s", "60")
    await lead(manager)
    await SimulatedInstance("i-k", "127.0.0.1:9299").register(etcd_client, cluster)
    reporter = await asyncio.create_subprocess_exec(sys.executable, "-c", REPORTER, manager.address, "i-k")
    try:
        async with ManagerClient(manager.address) as client:
            await wait_reported(client, "i-k")
            assert await state_of(client, "i-k") == common_pb2.INSTANCE_STATE_SERVING
            reporter.kill()  # its report stream ends (as a closed one does, on the manager's side)
            await wait_until(lambda: _has_state(client, "i-k", common_pb2.INSTANCE_STATE_UNHEALTHY), 5,
                             "i-k unhealthy")
            with pytest.raises(Unavailable, match="1 unhealthy"):
                await client.dispatch("r-1", 10)
    finally:
        if reporter.returncode is None:
            reporter.kill()
        await reporter.wait()


async def _has_state(client: ManagerClient, instance_id: str, state: int) -> bool:
    return await state_of(client, instance_id) == state


async def test_prefix_policy_keeps_a_prefix_on_its_instance_within_the_slack(managers, instances):
    manager = await managers("m-a", "--prefix-load-slack", "2")
    await lead(manager)
    to_manager = lambda: [manager.address]  # noqa: E731
    holder, *_ = [await instances(SimulatedInstance(f"i-{n}", f"127.0.0.1:{9500 + n}"), to_manager) for n in range(3)]
    shared = prefix_chunk_keys(range(64), MAX_PREFIX_CHUNKS)
    async with ManagerClient(manager.address) as client:
        await wait_reported(client, "i-0", "i-1", "i-2")
        assert await client.set_policy("prefix") == "prefix"
        first = await client.dispatch("r-1", 64, prefix_chunk_keys=shared)
        assert (first.instance_id, first.policy) == ("i-0", "prefix")  # equal loads: the smallest id

        await _report_queue(client, holder, num_running=1, num_waiting=1)  # less free, queue 2 = 0 + slack
        again = await client.dispatch("r-2", 80, prefix_chunk_keys=[*shared, 7])
        other = await client.dispatch("r-3", 64, prefix_chunk_keys=prefix_chunk_keys(range(500, 564), 8))
        assert again.instance_id == "i-0" and other.instance_id != "i-0"

        await _report_queue(client, holder, num_running=1, num_waiting=2)  # queue 3: past --prefix-load-slack 2
        assert (await client.dispatch("r-4", 64, prefix_chunk_keys=shared)).instance_id != "i-0"

        await client.dispatch("r-5", 4096, prefix_chunk_keys=range(MAX_PREFIX_CHUNKS))
        with pytest.raises(InvalidArgument, match=f"prefix_chunk_keys: at most {MAX_PREFIX_CHUNKS}.*got 257"):
            await client.dispatch("r-6", 4112, prefix_chunk_keys=range(MAX_PREFIX_CHUNKS + 1))


async def _report_queue(client: ManagerClient, instance: SimulatedInstance, num_running: int, num_waiting: int):
    """Make `instance` report this load and wait until the manager has it (waiting counts have no reservations).
    First past IN_TRANSIT_S: the report then counts (and replaces) the reservations of the dispatches before."""
    await asyncio.sleep(IN_TRANSIT_S)
    instance.num_running, instance.num_waiting = num_running, num_waiting

    async def reported():
        waiting = {i.instance_id: i.num_waiting for i in await client.list_instances()}
        return waiting[instance.instance_id] == num_waiting
    await wait_until(reported, 5, f"{instance.instance_id} reporting {num_waiting} waiting")


async def test_policy_and_drain_marks_survive_a_manager_restart(managers, instances):
    manager = await managers("m-a")
    await lead(manager)
    await instances(SimulatedInstance("i-a", "127.0.0.1:9301"), lambda: [m.address for m in alive])
    alive = [manager]
    async with ManagerClient(manager.address) as client:
        assert await client.get_policy() == "load"
        with pytest.raises(InvalidArgument, match="dispatch: unknown policy 'fastest'"):
            await client.set_policy("fastest")
        assert await client.set_policy("round_robin") == "round_robin"
        await client.drain("i-a")
    assert await manager.stop() == 0

    restarted = await managers("m-b")
    alive[:] = [restarted]
    await lead(restarted)
    async with ManagerClient(restarted.address) as client:
        assert await client.get_policy() == "round_robin"
        assert await state_of(client, "i-a") == common_pb2.INSTANCE_STATE_DRAINING
        with pytest.raises(Unavailable, match="1 draining"):
            await client.dispatch("r-1", 10)
        await client.undrain("i-a")  # the stored mark goes: a manager started after this would not see it
    assert await restarted.stop() == 0
    again = await managers("m-c")
    alive[:] = [again]
    await lead(again)
    async with ManagerClient(again.address) as client:
        await wait_until(lambda: _has_state(client, "i-a", common_pb2.INSTANCE_STATE_SERVING), 5, "i-a serving")


async def test_the_drain_mark_of_an_instance_that_is_gone_can_be_undone(managers, etcd_client, cluster):
    """Otherwise an instance started again under that id would come back draining for good."""
    manager = await managers("m-a")
    await lead(manager)
    key = f"/ferry/{cluster}/config/drain/i-gone"
    await etcd_client.kv.put(key, json.dumps({"instance_id": "i-gone"}), timeout=5)
    async with ManagerClient(manager.address) as client:
        with pytest.raises(NotFound, match="not registered"):
            await client.drain("i-never")

        async def undone() -> bool:
            try:
                return (await client.undrain("i-gone")).instance_id == "i-gone"
            except NotFound:  # the manager has not read the mark yet
                return False
        await wait_until(undone, 5, "the mark undone")
    assert not (await etcd_client.kv.get(key, timeout=5)).kvs


async def test_set_policy_through_one_manager_reaches_the_other(managers):
    first, second = await managers("m-1"), await managers("m-2")
    async with ManagerClient(first.address) as one, ManagerClient(second.address) as two:
        await one.set_policy("queue")
        await wait_until(lambda: _policy_is(two, "queue"), 5, "policy seen by m-2")


async def _policy_is(client: ManagerClient, name: str) -> bool:
    return await client.get_policy() == name


async def test_standby_refuses_dispatch_then_takes_over_when_the_leader_dies(managers, instances):
    leader = await managers("m-1")
    await lead(leader)
    standby = await managers("m-2")
    alive = [leader, standby]
    await instances(SimulatedInstance("i-a", "127.0.0.1:9401"), lambda: [m.address for m in alive])
    async with ManagerClient(leader.address) as to_leader, ManagerClient(standby.address) as to_standby:
        await wait_reported(to_leader, "i-a")
        with pytest.raises(Unavailable, match=f"not the leader; leader is at {leader.address}"):
            await to_standby.dispatch("r-1", 10)
        status = await to_standby.get_cluster_status()  # forwarded to the leader, which has the load
        assert (status.answered_by, status.leader_id, status.num_serving) == ("m-1", "m-1", 1)

        leader.kill()
        alive.remove(leader)
        killed_at = time.monotonic()
        placement = await wait_until(lambda: _try_dispatch(to_standby), LEASE_TTL_S + 5, "standby dispatching")
        took_s = time.monotonic() - killed_at
        print(f"standby dispatching {took_s:.2f} s after SIGKILL of the leader (lease TTL {LEASE_TTL_S} s)")
        assert placement.instance_id == "i-a"
        assert took_s <= LEASE_TTL_S + 3.0, f"takeover took {took_s:.2f} s with a {LEASE_TTL_S} s lease"
        status = await to_standby.get_cluster_status()
        assert (status.leader_id, status.answered_by) == ("m-2", "m-2")
        await wait_reported(to_standby, "i-a")  # the instance found the new leader


async def test_a_leader_cut_off_from_etcd_past_its_ttl_says_no_manager_leads(managers, running_etcd):
    """etcd down longer than the lease TTL: the leader steps down, but the leader key it last saw still names
    it (the watch cannot see the key go). Its GetClusterStatus said `leader m-1` all the same, so `ferryctl
    status` named a leader that neither dispatched nor took load reports for as long as etcd stayed away."""
    leader = await managers("m-1")
    await lead(leader)
    running_etcd.terminate()
    stopped_at = time.monotonic()
    async with ManagerClient(leader.address) as client:
        async def no_leader():
            status = await client.get_cluster_status()
            return status.leader_id == "" and status.answered_by == "m-1"
        await wait_until(no_leader, LEASE_TTL_S + 5, "m-1 saying no manager leads")
        print(f"no leader reported {time.monotonic() - stopped_at:.2f} s after etcd stopped (TTL {LEASE_TTL_S} s)")
        with pytest.raises(Unavailable, match="no leader is elected yet"):
            await client.dispatch("r-1", 10)
        running_etcd.start()
        await lead(leader)  # back by itself once etcd answers


async def _try_dispatch(client: ManagerClient):
    try:
        return await client.dispatch("r-takeover", 10, timeout_s=0.5)
    except Unavailable:
        return None


async def test_list_requests_fans_out_with_a_deadline(managers, instances):
    manager = await managers("m-a", "--list-requests-timeout-s", "1.0")
    await lead(manager)
    to_manager = lambda: [manager.address]  # noqa: E731
    await instances(await serving_instance("i-a", ["r-1", "r-2"]), to_manager)
    await instances(await serving_instance("i-b", ["r-3"]), to_manager)
    await instances(SimulatedInstance("i-dead", "127.0.0.1:1"), to_manager)  # nothing listens there
    async with ManagerClient(manager.address) as client:
        await wait_reported(client, "i-a", "i-b", "i-dead")
        everything = await client.list_requests()
        assert sorted((r.instance_id, r.request_id) for r in everything) == [
            ("i-a", "r-1"), ("i-a", "r-2"), ("i-b", "r-3")]
        assert [r.request_id for r in await client.list_requests("i-b")] == ["r-3"]
        with pytest.raises(NotFound):
            await client.list_requests("i-nope")
        with pytest.raises(Unavailable, match="i-dead did not answer"):
            await client.list_requests("i-dead")


async def test_no_instance_and_reflection(managers):
    manager = await managers("m-a")
    await lead(manager)
    async with ManagerClient(manager.address) as client:
        with pytest.raises(Unavailable, match="no instance is registered"):
            await client.dispatch("r-1", 10)
    channel = insecure_channel(manager.address)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for reply in replies for s in reply.list_services_response.service]
    finally:
        await channel.close()
    assert {"ferry.v1.ManagerService", "ferry.v1.AdminService", "grpc.health.v1.Health"} <= set(names)
