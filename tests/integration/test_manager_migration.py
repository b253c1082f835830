"""The manager's migration side as a real process against a real etcd: the migration loop,
Drain, admin Migrate, ListMigrations, metrics and the stored migration policy.

Instances are simulated from the test: an etcd record, a ReportLoad stream, and an
InstanceService whose MigrateOut moves a request between the simulated instances'
books (their next load reports show it) the way a committed migration would.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from etcd3aio import Etcd3Client, prefix_range_end

from services.common.errors import (Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted,
                                    Unavailable)
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import (common_pb2, instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc,
                                          transfer_pb2)
from services.common.election import leader_key
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.pick_announcement import SOURCE_BUSY, AnnouncedPick, pick_to_metadata, refused_by_metadata
from services.instance.manager_client import ManagerLink
from services.instance.migration import MigrationDriver
from services.instance.migration_domain import MigrateOutPlan, MigrationSettings, RefusedByTransfer
from services.instance.migration_slots import MigrationSlots
from services.instance.server import InstanceServicer
from services.manager.client import ManagerClient
from services.manager.domain import InstanceId
from services.manager.instance_client import InstanceChannels
from services.manager.migration import MigrationOrder, MigrationTrigger, SourceBusy
from services.manager.migration_settle import SourceUnanswered
from tests.integration.manager_harness import SimulatedInstance, leader_of, start_manager, wait_until

pytestmark = pytest.mark.timeout(90)

BLOCKS_PER_REQUEST = 10


class MigratingInstance(instance_pb2_grpc.InstanceServiceServicer):
    """ListRequests and MigrateOut over a shared registry of simulated instances."""

    def __init__(self, sim: SimulatedInstance, peers: dict[str, MigratingInstance]) -> None:
        self.sim = sim
        self.peers = peers
        self.request_ids: list[str] = []
        self.refuse: str = ""  # non-empty: MigrateOut answers RESOURCE_EXHAUSTED with this text
        self.refused_by = ""  # ... naming the party that ran out in x-ferry-refused-by ("": none, an older source)
        self.is_busy = False  # MigrateOut refused as a source whose own migration slots are busy refuses it
        self.gate: asyncio.Event | None = None  # set: MigrateOut waits for it before it moves anything
        self.calls: list[instance_pb2.MigrateOutRequest] = []
        self.list_delay_s = 0.0  # how long ListRequests takes (an instance busy in a long step)
        self.answer_delay_s = 0.0  # how long MigrateOut waits after the move before it answers (a frozen source)
        self.moved_meanwhile_to = ""  # non-empty: another migration moved the request there just before MigrateOut
        self.hang_s = 0.0  # how long MigrateOut waits before it moves anything (a source frozen before the commit)
        self.hang_after_pick_s = 0.0  # ... after it announced its pick (initial metadata), as a real source does
        # request id: (RequestInfo.origin, migrated_from_instance_id, migration_id)
        self.origins: dict[str, tuple[int, str, str]] = {}
        self.max_sequence_len = 0  # non-zero: how long its requests may grow; a destination serving less gets none

    def hold(self, *request_ids: str, origin: int = instance_pb2.REQUEST_ORIGIN_DISPATCHED,
             migrated_from: str = "", migration_id: str = "") -> None:
        self.request_ids.extend(request_ids)
        self.origins.update({r: (origin, migrated_from, migration_id) for r in request_ids})
        self._sync()

    def migrated_in(self, request_id: str, src_instance_id: str) -> None:
        self.hold(request_id, origin=instance_pb2.REQUEST_ORIGIN_MIGRATED_IN, migrated_from=src_instance_id)

    async def ListRequests(self, request, context):
        await asyncio.sleep(self.list_delay_s)
        return instance_pb2.ListRequestsResponse(requests=[
            instance_pb2.RequestInfo(request_id=r, instance_id=self.sim.instance_id, num_tokens=20, state="running",
                                     origin=self.origins[r][0], migrated_from_instance_id=self.origins[r][1],
                                     migration_id=self.origins[r][2])
            for r in self.request_ids])

    async def MigrateOut(self, request, context):
        self.calls.append(request)
        await asyncio.sleep(self.hang_s)
        if self.gate is not None:
            await self.gate.wait()
        if self.is_busy:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this instance already runs 1 migration(s), "
                                "the most --max-concurrent-migrations 1 allows", trailing_metadata=SOURCE_BUSY)
        if self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.refuse,
                                trailing_metadata=refused_by_metadata(self.refused_by) if self.refused_by else ())
        if self.peers[request.dst_instance_id].sim.num_free_migration_out_slots == 0:  # its PrepareMigrateIn refused
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this instance already runs 1 migration(s), "
                                "the most --max-concurrent-migrations 1 allows; retry later or pick another instance")
        if 0 < request.dst_max_model_len < self.max_sequence_len:  # as a real source refuses it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no request that fits the destination's "
                                f"max_model_len of {request.dst_max_model_len} tokens")
        candidates = [r for r in self.request_ids if r not in request.exclude_request_ids]
        request_id = request.request_id or (candidates[0] if candidates else "")
        if self.hang_after_pick_s:
            migration_id = f"{self.sim.instance_id}-m{len(self.calls)}"
            await context.send_initial_metadata(pick_to_metadata(request_id, migration_id))
            await asyncio.sleep(self.hang_after_pick_s)
        if self.moved_meanwhile_to and request_id in self.request_ids:
            self.request_ids.remove(request_id)
            self.peers[self.moved_meanwhile_to].migrated_in(request_id, self.sim.instance_id)
        if request_id not in self.request_ids:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request_id!r} is not here")
        self.request_ids.remove(request_id)
        self._sync()
        self.peers[request.dst_instance_id].migrated_in(request_id, self.sim.instance_id)
        await asyncio.sleep(self.answer_delay_s)
        return instance_pb2.MigrateOutResponse(
            request_id=request_id, src_instance_id=self.sim.instance_id, dst_instance_id=request.dst_instance_id,
            num_blocks=BLOCKS_PER_REQUEST, num_bytes=BLOCKS_PER_REQUEST * 4096, num_stages=2,
            backend=transfer_pb2.TRANSFER_BACKEND_GRPC, duration_ms=12.5, downtime_ms=1.5)

    def _sync(self) -> None:
        self.sim.num_running = len(self.request_ids)
        self.sim.num_free_blocks = 1000 - BLOCKS_PER_REQUEST * len(self.request_ids)


@pytest.fixture
async def etcd_client(etcd):
    client = Etcd3Client([etcd.endpoint])
    await client.connect()
    yield client
    await client.close()


@pytest.fixture
async def world(etcd, etcd_client, cluster, tmp_path):
    """start(n, *manager_args) → (manager, client, {id: MigratingInstance}); everything stops at the end."""
    managers, sims, clients = [], [], []

    async def start(num_instances: int, *args: str, metrics_port: int = 0, max_model_lens: tuple[int, ...] = ()):
        manager = await start_manager(etcd.endpoint, cluster, f"m-{len(managers)}", tmp_path,
                                      "--report-timeout-s", "2", "--migration-interval-s", "0.1",
                                      "--metrics-port", str(metrics_port), *args)
        managers.append(manager)
        await wait_until(lambda: _leads(manager), 10, "manager leading")
        peers: dict[str, MigratingInstance] = {}
        for n in range(num_instances):
            sim = SimulatedInstance(f"i-{n}", "", report_interval_s=0.05,
                                    max_model_len=max_model_lens[n] if max_model_lens else 0)
            servicer = peers[sim.instance_id] = MigratingInstance(sim, peers)
            sim.server = await start_grpc_server("127.0.0.1", 0, [(
                instance_pb2_grpc.add_InstanceServiceServicer_to_server, servicer)], ["ferry.v1.InstanceService"])
            sim.address = sim.server.address
            await sim.register(etcd_client, cluster)
            sim.start_reporting(lambda: [m.address for m in managers])
            sims.append(sim)
        client = ManagerClient(manager.address, timeout_s=5)
        clients.append(client)
        await wait_until(lambda: _all_reported(client, num_instances), 10, "instances reported")
        return manager, client, peers

    yield start
    for client in clients:
        await client.close()
    for sim in sims:
        await sim.stop()
    for manager in managers:
        await manager.stop()


async def _leads(manager) -> bool:
    return await leader_of(manager) == manager.manager_id


async def _all_reported(client: ManagerClient, num_instances: int) -> bool:
    infos = await client.list_instances()
    return len(infos) == num_instances and all(i.report_age_s >= 0 for i in infos)


async def running(client: ManagerClient) -> dict[str, int]:
    return {i.instance_id: i.num_running for i in await client.list_instances()}


async def test_the_loop_spreads_a_flooded_instance_and_keeps_a_history(world):
    port = free_port()
    _, client, peers = await world(3, metrics_port=port)
    peers["i-0"].hold(*(f"r-{n}" for n in range(9)))
    await wait_until(lambda: _running_is(client, {"i-0": 9, "i-1": 0, "i-2": 0}), 5, "flood reported")
    policy = await client.update_policy(migration_enabled=True, migration_threshold=0.0)
    assert (policy.dispatch, policy.migration_enabled, policy.migration_pairing) == ("load", True, "load")
    await wait_until(lambda: _running_is(client, {"i-0": 3, "i-1": 3, "i-2": 3}), 15, "load spread evenly")
    # the sixth record is kept once the manager has MigrateOut's reply, which may come after the loads show it
    await wait_until(lambda: _num_migrations(client, 6), 5, "six migrations recorded")

    migrations = (await client.list_migrations()).migrations
    assert len(migrations) == 6 and {m.outcome for m in migrations} == {"committed"}
    assert {m.src_instance_id for m in migrations} == {"i-0"} and {m.trigger for m in migrations} == {"load"}
    assert {m.dst_instance_id for m in migrations} == {"i-1", "i-2"}
    assert (migrations[0].num_blocks, migrations[0].backend, migrations[0].downtime_ms) == (10, "grpc", 1.5)
    assert len((await client.list_migrations(instance_id="i-1")).migrations) == 3
    assert all(call.selection == instance_pb2.MIGRATION_SELECTION_SHORTEST_RUNNING for call in peers["i-0"].calls)
    # the loop stays put once balanced (hysteresis): no more calls a while later
    num_calls = sum(len(p.calls) for p in peers.values())
    await asyncio.sleep(0.6)
    assert sum(len(p.calls) for p in peers.values()) == num_calls

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'ferry_manager_migrations_total{outcome="committed",trigger="load"} 6.0' in text
    assert "ferry_manager_migrated_bytes_total 245760.0" in text
    assert "ferry_manager_migration_downtime_seconds_count 6.0" in text


async def test_refusals_are_counted_apart_from_failures_and_the_loop_lives_on(world):
    """A destination with no room (RESOURCE_EXHAUSTED) is no fault: recorded and counted `refused`, not `failed`
    (before, `failed`, and the README's PromQL for faults had to leave RESOURCE_EXHAUSTED out)."""
    port = free_port()
    _, client, peers = await world(2, "--migration-enabled", "--migration-threshold", "0", metrics_port=port)
    peers["i-0"].refuse = "destination i-1 has no free batch slot"
    peers["i-0"].hold("r-1", "r-2", "r-3", "r-4")
    await wait_until(lambda: _num_migrations(client, 2), 10, "two refused attempts")
    refused = (await client.list_migrations()).migrations
    assert {(m.outcome, m.reason) for m in refused} == {("refused", "RESOURCE_EXHAUSTED")}
    assert refused[0].message == "destination i-1 has no free batch slot"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert float(re.search(r'ferry_manager_migrations_total\{outcome="refused",trigger="load"\} (\S+)', text)[1]) >= 2
    assert 'ferry_manager_migrations_total{outcome="failed",trigger="load"} 0.0' in text
    assert 'ferry_manager_migration_failures_total{reason="RESOURCE_EXHAUSTED"}' not in text
    peers["i-0"].refuse = ""
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 2}), 10, "the loop recovered")


async def test_a_busy_transfer_service_is_a_failure_named_as_such_not_the_destinations_refusal(world):
    """A transfer service whose staging slots stayed busy also ends MigrateOut RESOURCE_EXHAUSTED: it was recorded
    `refused` (no fault) and admin Migrate said "the destination refused". The source names the party that ran out
    (x-ferry-refused-by): a transfer service's is `failed`, counted in the failures, and Migrate names it."""
    port = free_port()
    _, client, peers = await world(3, "--migration-enabled", "--migration-threshold", "0", metrics_port=port)
    busy = ("request r-1 not migrated, it keeps running on i-0: a transfer service had no room for the copy to i-1: "
            "all 4 staging slots stayed busy for 5.0 s")
    peers["i-0"].refuse, peers["i-0"].refused_by = busy, "transfer"
    peers["i-0"].hold("r-1", "r-2", "r-3", "r-4")
    await wait_until(lambda: _num_migrations(client, 1), 10, "a failed attempt")
    failed = (await client.list_migrations()).migrations
    assert {(m.outcome, m.reason, m.message) for m in failed} == {("failed", "RESOURCE_EXHAUSTED", busy)}
    with pytest.raises(ResourceExhausted, match="a transfer service, not destination instance i-2, refused the "
                       "migration: request r-1 .* stayed busy for 5.0 s \\(recorded failed: the request runs on at "
                       "i-0\\)") as error:
        await client.migrate(request_id="r-1", dst_instance_id="i-2")
    assert "destination instance i-2 refused" not in error.value.message
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert float(re.search(r'ferry_manager_migration_failures_total\{reason="RESOURCE_EXHAUSTED"\} (\S+)', text)[1]) >= 2
    assert 'ferry_manager_migrations_total{outcome="refused",trigger="admin"} 0.0' in text
    # a destination's refusal, named as such, is still `refused`
    peers["i-0"].refuse, peers["i-0"].refused_by = "no free batch slot on i-2", "destination"
    with pytest.raises(ResourceExhausted, match="destination instance i-2 refused the migration: no free batch"):
        await client.migrate(request_id="r-2", dst_instance_id="i-2")
    assert [m.outcome for m in (await client.list_migrations(request_id="r-2")).migrations] == ["refused"]


async def test_a_pd_hand_off_a_busy_transfer_service_failed_is_reported_failed(world):
    """A prefill instance's own hand-off reports its failure (ReportMigration), RESOURCE_EXHAUSTED both where the
    decode instance had no room and where a transfer service's staging slots stayed busy: the latter was kept
    `refused` too. The report names the party (refused_by); an older instance's, naming none, reads as before."""
    manager, client, _ = await world(2)
    link = ManagerLink(SimpleNamespace(leader=SimpleNamespace(address=manager.address)), timeout_s=5.0)
    try:
        for request_id, error in (("r-t", RefusedByTransfer("all 4 staging slots stayed busy for 5.0 s")),
                                  ("r-d", ResourceExhausted("no free batch slot on i-1"))):
            plan = MigrateOutPlan(request_id, "i-1", "", "", None)
            await link.report_failed_migration(plan, "i-0", error, time.time())
    finally:
        await link.close()
    kept = {m.request_id: (m.outcome, m.reason) for m in (await client.list_migrations()).migrations}
    assert kept == {"r-t": ("failed", "RESOURCE_EXHAUSTED"), "r-d": ("refused", "RESOURCE_EXHAUSTED")}


async def test_drain_moves_everything_off_and_then_reports_drained(world):
    _, client, peers = await world(3)  # the load-balancing loop is off: drains move anyway
    peers["i-1"].hold("r-a", "r-b", "r-c")
    await wait_until(lambda: _running_is(client, {"i-0": 0, "i-1": 3, "i-2": 0}), 5, "requests reported")
    answer = await client.drain("i-1")
    assert answer.state == common_pb2.INSTANCE_STATE_DRAINING and not answer.is_drained
    assert answer.num_remaining == 3
    await wait_until(lambda: _is_drained(client, "i-1"), 15, "i-1 drained")
    assert (await running(client))["i-1"] == 0 and sorted(peers["i-0"].request_ids + peers["i-2"].request_ids) == [
        "r-a", "r-b", "r-c"]
    again = await client.drain("i-1")
    assert again.is_drained and again.num_remaining == 0
    assert {m.trigger for m in (await client.list_migrations()).migrations} == {"drain"}


async def test_a_drain_passes_over_a_freer_instance_that_serves_shorter_sequences(world):
    # Found outside-in: an instance that joined with --max-model-len 256 and the most free blocks drew every
    # move of a drain and refused each request that may grow past 256 tokens, so a SIGTERMed instance spent
    # its grace on refusals and its requests were cut and resumed instead of migrated.
    # A refused pair backs off for longer than the test runs.
    _, client, peers = await world(3, "--migration-failure-backoff-s", "60", max_model_lens=(256, 1024, 1024))
    peers["i-2"].hold("r-x")  # i-0, the short one, stays the freest
    peers["i-1"].hold("r-a", "r-b", "r-c")
    peers["i-1"].max_sequence_len = 1024  # none fits on i-0
    await wait_until(lambda: _running_is(client, {"i-0": 0, "i-1": 3, "i-2": 1}), 5, "requests reported")
    await client.drain("i-1")
    await wait_until(lambda: _is_drained(client, "i-1"), 15, "i-1 drained")
    # The first move (every instance settled) went to i-2. A later one may have gone to i-0 once, refused: after
    # a move both sides sit out until their next load report, and i-1's may come before i-2's (2 runs in 12
    # with a CPU hog beside); one refusal backs the pair off (a move asked again on a load report not yet
    # updated may add a call, refused NOT_FOUND).
    calls = [(call.request_id, call.dst_instance_id) for call in peers["i-1"].calls]
    assert calls[0][1] == "i-2" and [dst for _, dst in calls].count("i-0") <= 1, calls
    assert sorted(peers["i-2"].request_ids) == ["r-a", "r-b", "r-c", "r-x"]


async def test_a_request_not_found_while_an_instance_is_silent_is_unavailable_not_not_found(world):
    """The silent instance may hold it (a long prefill step keeps an instance from answering):
    NOT_FOUND would tell the operator the request is gone."""
    _, client, peers = await world(2, "--list-requests-timeout-s", "0.5")
    peers["i-1"].hold("r-busy")
    peers["i-1"].list_delay_s = 3.0
    with pytest.raises(Unavailable, match="'r-busy' is on none of the instances that answered.*i-1 did not answer"):
        await client.migrate(request_id="r-busy")
    peers["i-1"].list_delay_s = 0.0
    with pytest.raises(NotFound, match="'r-gone' is not running or waiting on any instance"):
        await client.migrate(request_id="r-gone")


async def test_admin_migrate_finds_the_request_and_checks_its_arguments(world):
    _, client, peers = await world(3, "--migration-timeout-s", "90")
    # what ferryctl migrate waits for: 90 s + two ListRequests fan-outs (2 s each) + a check (2 s) + forwarding (1 s)
    assert (await client.get_cluster_status()).migrate_time_s == 97.0
    with pytest.raises(FailedPrecondition, match="nothing to migrate"):
        await client.migrate()
    with pytest.raises(NotFound, match="destination instance 'i-9'"):  # the bad argument first, idle or not
        await client.migrate(dst_instance_id="i-9")
    with pytest.raises(InvalidArgument, match="dst_instance_id: src_instance_id names i-1 too"):  # idle or not
        await client.migrate(src_instance_id="i-1", dst_instance_id="i-1")
    peers["i-0"].hold("r-1", "r-2")
    peers["i-1"].hold("r-3")
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 1, "i-2": 0}), 5, "requests reported")
    moved = await client.migrate(request_id="r-2")
    assert (moved.request_id, moved.src_instance_id, moved.dst_instance_id) == ("r-2", "i-0", "i-2")
    assert (moved.num_blocks, moved.num_stages, moved.backend, moved.duration_ms) == (10, 2, "grpc", 12.5)
    assert peers["i-2"].request_ids == ["r-2"] and peers["i-0"].calls[-1].request_id == "r-2"
    picked = await client.migrate(src_instance_id="i-0", dst_instance_id="i-1")
    assert (picked.request_id, picked.dst_instance_id) == ("r-1", "i-1")

    with pytest.raises(NotFound, match="'r-zz' is not running or waiting on any instance"):
        await client.migrate(request_id="r-zz")
    with pytest.raises(NotFound, match="'i-9' is not registered"):
        await client.migrate(src_instance_id="i-9")
    with pytest.raises(NotFound, match="destination instance 'i-9'"):
        await client.migrate(request_id="r-3", dst_instance_id="i-9")
    with pytest.raises(FailedPrecondition, match="source and destination are both i-1"):
        await client.migrate(request_id="r-3", dst_instance_id="i-1")
    peers["i-1"].refuse = "no room on i-2"
    with pytest.raises(ResourceExhausted, match="destination instance i-2 refused the migration: no room on i-2 "
                       r"\(recorded refused: the request runs on at i-1\)"):
        await client.migrate(request_id="r-3", dst_instance_id="i-2")
    history = (await client.list_migrations(request_id="r-3")).migrations
    assert [(m.outcome, m.reason, m.trigger) for m in history] == [("refused", "RESOURCE_EXHAUSTED", "admin")]
    peers["i-1"].refuse = ""
    await wait_until(lambda: _running_is(client, {"i-0": 0, "i-1": 2, "i-2": 1}), 5, "moves reported")
    busiest = await client.migrate()  # nothing named: the least free busy instance gives one to the freest
    assert (busiest.src_instance_id, busiest.dst_instance_id) == ("i-1", "i-0")


async def test_a_request_another_migration_moved_meanwhile_is_aborted_not_not_found(world):
    """Two operators move one request at once: the second finds it gone from the source it looked up."""
    _, client, peers = await world(3)
    peers["i-0"].hold("r-1")
    await wait_until(lambda: _running_is(client, {"i-0": 1, "i-1": 0, "i-2": 0}), 5, "requests reported")
    peers["i-0"].moved_meanwhile_to = "i-2"
    with pytest.raises(Aborted, match="'r-1' moved from i-0 to i-2 while this Migrate was under way"):
        await client.migrate(request_id="r-1", dst_instance_id="i-1")


async def test_a_source_that_moved_the_request_but_gave_no_answer_is_settled_by_the_destination(world):
    """The source froze right after the commit: its MigrateOut runs past the manager's deadline. The
    destination holds the request, so the migration is recorded committed (it used to be "failed")."""
    _, client, peers = await world(2, "--migration-timeout-s", "1")
    peers["i-0"].hold("r-1", "r-2")
    peers["i-0"].answer_delay_s = 5.0
    moved = await client.migrate(request_id="r-1", dst_instance_id="i-1")
    assert (moved.request_id, moved.dst_instance_id, moved.num_blocks) == ("r-1", "i-1", 0)  # no figures
    (record,) = (await client.list_migrations(request_id="r-1")).migrations
    assert record.outcome == "committed" and "gave no answer" in record.message
    peers["i-0"].answer_delay_s, peers["i-0"].hang_s = 0.0, 30.0  # frozen before anything moved
    with pytest.raises(Unavailable, match="MigrateOut on source instance i-0 at .*: "):
        await client.migrate(request_id="r-2", src_instance_id="i-0", dst_instance_id="i-1")
    (record,) = (await client.list_migrations(request_id="r-2")).migrations
    # Not on the destination (yet): a source that gave no answer may have committed all the same, so
    # "unknown" until the destination or the source tells (test_migration_settle.py), not "failed".
    assert (record.outcome, record.reason) == ("unknown", "DEADLINE_EXCEEDED")


async def test_a_migrate_that_never_reached_its_source_is_failed_not_unknown(world):
    """Before, a source whose connection was refused (stopped) was recorded like one that froze after the commit:
    "unknown". gRPC failed the call before sending it, so nothing can have moved: "failed", saying so."""
    _, client, peers = await world(2, "--migration-timeout-s", "1")
    peers["i-0"].hold("r-1")
    await wait_until(lambda: _running_is(client, {"i-0": 1, "i-1": 0}), 5, "requests reported")
    await peers["i-0"].sim.server.stop(0)  # gone: the error names the source
    with pytest.raises(Unavailable, match="MigrateOut on source instance i-0 at .* never reached it"):
        await client.migrate(request_id="r-1", src_instance_id="i-0", dst_instance_id="i-1")
    (record,) = (await client.list_migrations(request_id="r-1")).migrations
    assert (record.outcome, record.reason) == ("failed", "UNAVAILABLE") and "nothing was migrated" in record.message


async def test_a_request_the_frontend_resumed_on_the_destination_while_its_source_froze_is_no_commit(world):
    """Found by a black-box run: the source froze past the MigrateOut deadline, the frontend resumed the request on
    the destination, and the destination holding it made Migrate answer ok with 0 blocks, recorded committed,
    while the source logged migration_aborted. The destination says how it came by the request: a resume."""
    _, client, peers = await world(2, "--migration-timeout-s", "1")
    peers["i-0"].hold("r-1")
    peers["i-0"].hang_s = 30.0  # frozen before anything moved
    peers["i-1"].hold("r-1", origin=instance_pb2.REQUEST_ORIGIN_RESUMED)
    with pytest.raises(Unavailable, match="MigrateOut on source instance i-0"):
        await client.migrate(request_id="r-1", src_instance_id="i-0", dst_instance_id="i-1")
    await wait_until(lambda: _outcome_is(client, "r-1", "failed"), 10, "the migration settled failed")
    (record,) = (await client.list_migrations(request_id="r-1")).migrations
    assert "holds the request resumed, not migrated in from i-0" in record.message


async def _outcome_is(client: ManagerClient, request_id: str, outcome: str) -> bool:
    return [r.outcome for r in (await client.list_migrations(request_id=request_id)).migrations] == [outcome]


async def test_a_hand_off_that_could_not_reach_its_destination_takes_it_out_of_placements(world):
    """i-1 died (its reports stopped; its lease has not ended): once i-0 reports that a PD hand-off to it
    failed UNAVAILABLE, PlaceDecode sends the next requests elsewhere at once, not for the rest of the
    report timeout (found by a black-box run)."""
    manager, client, peers = await world(3)
    peers["i-1"].sim.num_free_blocks, peers["i-2"].sim.num_free_blocks = 900, 100  # i-1 by far the freer one
    await wait_until(lambda: _free_is(client, "i-1", 900), 5, "loads reported")
    async with insecure_channel(manager.address) as channel:
        stub = manager_pb2_grpc.ManagerServiceStub(channel)

        async def place(request_id: str) -> str:
            return (await stub.PlaceDecode(manager_pb2.PlaceDecodeRequest(
                request_id=request_id, src_instance_id="i-0", num_blocks=1), timeout=5)).instance_id
        assert await place("r-1") == "i-1"
        peers["i-1"].sim.is_reporting = False
        await stub.ReportMigration(manager_pb2.MigrationRecord(
            request_id="r-1", src_instance_id="i-0", dst_instance_id="i-1", outcome="failed", reason="UNAVAILABLE",
            message="failed to connect", trigger="pd"), timeout=5)
        assert await place("r-2") == "i-2"
        peers["i-1"].sim.is_reporting = True  # alive after all: back with its next report
        await wait_until(lambda: _placed_on(place, "r-3", "i-1"), 5, "i-1 placed again")


async def _free_is(client: ManagerClient, instance_id: str, num_free_blocks: int) -> bool:
    return any(i.instance_id == instance_id and i.num_free_blocks == num_free_blocks
               for i in await client.list_instances())


async def _placed_on(place, request_id: str, instance_id: str) -> bool:
    return await place(request_id) == instance_id


async def test_partial_policy_changes_made_at_once_both_take_effect(world):
    """Each merges into what is stored in one compare-and-put: neither overwrites the other's field."""
    _, client, _ = await world(1)
    for _ in range(3):
        await asyncio.gather(client.update_policy(dispatch="flood"), client.update_policy(migration_enabled=True),
                             client.update_policy(migration_threshold=3.5))
        policy = await client.get_full_policy()
        assert (policy.dispatch, policy.migration_enabled, policy.migration_threshold) == ("flood", True, 3.5)
        await client.update_policy(dispatch="load", migration_enabled=False, migration_threshold=1.0)


async def test_the_migration_policy_is_stored_and_survives_a_restart(world, etcd, cluster, tmp_path):
    manager, client, _ = await world(1)
    with pytest.raises(InvalidArgument, match="migration_threshold must be a finite number >= 0"):
        await client.update_policy(migration_threshold=-1.0)
    with pytest.raises(InvalidArgument, match="unknown pairing 'x'"):
        await client.update_policy(migration_pairing="x")
    await client.update_policy(dispatch="flood", migration_enabled=True, migration_threshold=2.5,
                               migration_selection=instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING)
    assert (await client.update_policy(migration_enabled=False)).dispatch == "flood"  # unset fields keep
    assert await manager.stop() == 0
    restarted = await start_manager(etcd.endpoint, cluster, "m-restarted", tmp_path)
    try:
        async with ManagerClient(restarted.address) as again:
            policy = await again.get_full_policy()
    finally:
        await restarted.stop()
    assert (policy.dispatch, policy.migration_enabled, policy.migration_threshold, policy.migration_selection) == (
        "flood", False, 2.5, instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING)


async def test_the_history_outlives_the_manager_that_kept_it(world, etcd, etcd_client, cluster, tmp_path):
    manager, client, peers = await world(2)
    peers["i-0"].hold("r-1")
    await wait_until(lambda: _running_is(client, {"i-0": 1, "i-1": 0}), 5, "request reported")
    await client.migrate(request_id="r-1")
    peers["i-1"].refuse = "no room"
    with pytest.raises(ResourceExhausted):
        await client.migrate(src_instance_id="i-1", dst_instance_id="i-0")
    kept = [(m.request_id, m.outcome, m.src_instance_id) for m in (await client.list_migrations()).migrations]
    assert kept == [("r-1", "committed", "i-0"), ("", "refused", "i-1")]
    await wait_until(lambda: _num_stored_migrations(etcd_client, cluster, 2), 10, "both records in etcd")
    assert await manager.stop() == 0
    successor = await start_manager(etcd.endpoint, cluster, "m-successor", tmp_path)
    try:
        async with ManagerClient(successor.address) as again:
            history = (await again.list_migrations()).migrations
    finally:
        await successor.stop()
    assert [(m.request_id, m.outcome, m.src_instance_id) for m in history] == kept


async def _num_stored_migrations(etcd_client: Etcd3Client, cluster: str, count: int) -> bool:
    prefix = f"/ferry/{cluster}/migrations/"
    return (await etcd_client.kv.get(prefix, range_end=prefix_range_end(prefix), count_only=True)).count == count


async def _running_is(client: ManagerClient, expected: dict[str, int]) -> bool:
    return await running(client) == expected


async def _num_migrations(client: ManagerClient, at_least: int) -> bool:
    return len((await client.list_migrations()).migrations) >= at_least


async def _is_drained(client: ManagerClient, instance_id: str) -> bool:
    return {i.instance_id: i.is_drained for i in await client.list_instances()}[instance_id]


async def test_place_decode_picks_an_instance_with_room_and_skips_those_that_refused(world):
    """A PD hand-off's PlaceDecode says how many blocks the request holds and which decode instances just refused
    it (RESOURCE_EXHAUSTED); the leader places it where it fits, on one that did not refuse."""
    manager, client, peers = await world(3)
    peers["i-1"].hold("a", "b", "c", "d", "e")  # 950 free blocks, 5 running: freeness 158
    peers["i-2"].sim.num_free_blocks = 300  # freeness 300, but no room for 500 blocks
    await wait_until(lambda: _free_is(client, "i-2", 300), 5, "loads reported")
    await wait_until(lambda: _free_is(client, "i-1", 950), 5, "loads reported")
    link = ManagerLink(SimpleNamespace(leader=SimpleNamespace(address=manager.address)), timeout_s=5.0)
    try:
        assert (await link.place_decode("r-1", "i-0", 500)).instance_id == "i-1"
        assert (await link.place_decode("r-2", "i-0", 1, refused=["i-1"])).instance_id == "i-2"
        with pytest.raises(ResourceExhausted, match="every decode instance refused request r-3"):
            await link.place_decode("r-3", "i-0", 1, refused=["i-1", "i-2"])
    finally:
        await link.close()


class PickThenHang:
    """A source's MigrationDriver that picks `r-42`, says so, then runs past the manager's deadline."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def migrate_out(self, plan, on_picked=None):
        await on_picked("r-42", "a-0123")
        await self.done.wait()
        raise Aborted("never mind")


async def test_a_migrate_out_past_its_deadline_names_the_request_its_source_picked():
    """A loop migration (the source picks) whose MigrateOut outlived the manager's deadline failed with no request
    id, so the manager could not ask the destination whether it committed: recorded failed, maybe wrongly. The
    source now names its pick in the call's initial metadata, and the deadline error carries it (real gRPC)."""
    servicer = InstanceServicer(runner=None)
    servicer.migrations = PickThenHang()
    server = await start_grpc_server("127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                       servicer)], ["ferry.v1.InstanceService"])
    channels = InstanceChannels()
    try:
        order = MigrationOrder(InstanceId("a"), server.address, InstanceId("b"), "127.0.0.1:1", MigrationTrigger.LOAD)
        with pytest.raises(SourceUnanswered) as raised:
            await channels.migrate_out(order, timeout_s=0.5)
        assert raised.value.__cause__.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert (raised.value.request_id, raised.value.migration_id) == ("r-42", "a-0123")
    finally:
        servicer.migrations.done.set()
        await channels.close()
        await server.stop(0)


async def test_a_migrate_out_names_its_pick_as_soon_as_the_source_announces_it():
    """MigrateOut is unary: its initial metadata came only with the answer, so a call cancelled before (the manager
    stopping) never knew the request. Read as a stream, the pick is told at once; a cancelled caller cancels it."""
    servicer = InstanceServicer(runner=None)
    servicer.migrations = PickThenHang()
    server = await start_grpc_server("127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                       servicer)], ["ferry.v1.InstanceService"])
    channels = InstanceChannels()
    picks: list[AnnouncedPick] = []
    try:
        order = MigrationOrder(InstanceId("a"), server.address, InstanceId("b"), "127.0.0.1:1", MigrationTrigger.LOAD)
        call = asyncio.create_task(channels.migrate_out(order, 30.0, picks.append))
        await wait_until(lambda: picks, 5, "the pick told")
        assert picks == [AnnouncedPick("r-42", "a-0123")] and not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        servicer.migrations.done.set()
        await channels.close()
        await server.stop(0)


async def test_the_next_leader_settles_a_migration_its_predecessor_left_unknown(world, etcd, etcd_client, cluster,
                                                                              tmp_path):
    """A MigrateOut cut short by its manager's shutdown is kept unknown (CANCELLED), with the request its source
    announced (before, none: nobody could find out where it went). A leader followed only its own unknown records:
    this one stayed unknown in the journal for good, though its source ran it on and committed. The next leader
    adopts and settles it."""
    manager, client, peers = await world(2, "--migration-enabled", "--migration-threshold", "0")
    peers["i-0"].hang_after_pick_s = 60.0
    peers["i-0"].hold("r-1", "r-2")
    await wait_until(lambda: peers["i-0"].calls, 10, "a MigrateOut under way")
    await asyncio.sleep(1.5)  # the pick announced (nothing outside the manager shows it read it: 0.3 s was tight at load 20)
    assert await manager.stop() == 0
    (left,) = await _stored_migrations(etcd_client, cluster)
    assert (left.outcome, left.reason, left.request_id, left.migration_id) == ("unknown", "CANCELLED", "r-1",
                                                                               "i-0-m1")
    peers["i-0"].request_ids.remove("r-1")  # the source ran it on: committed
    peers["i-1"].hold("r-1", origin=instance_pb2.REQUEST_ORIGIN_MIGRATED_IN, migrated_from="i-0",
                      migration_id="i-0-m1")
    successor = await start_manager(etcd.endpoint, cluster, "m-successor", tmp_path)
    try:
        async def settled():
            (stored,) = await _stored_migrations(etcd_client, cluster)  # in place: still one record
            return stored if stored.outcome != "unknown" else None
        stored = await wait_until(settled, 15, "the record settled by the next leader")
        assert (stored.outcome, stored.request_id, stored.reason) == ("committed", "r-1", "")
        assert "by migration i-0-m1" in stored.message
        assert "migration_adopted_settled" in successor.log_path.read_text()
    finally:
        await successor.stop()


async def test_a_source_whose_own_migration_slots_are_busy_is_no_failed_migration(world):
    """A PD prefill instance's own hand-offs held its one migration slot: the loop's MigrateOut, refused at once
    by the source, was recorded failed RESOURCE_EXHAUSTED and backed the pair off 2 s. The source marks that
    refusal (trailing metadata), so it is counted apart: no record, no failure, no backoff."""
    port = free_port()
    _, client, peers = await world(2, "--migration-enabled", "--migration-threshold", "0",
                                   "--migration-failure-backoff-s", "60", metrics_port=port)
    peers["i-0"].is_busy = True
    peers["i-0"].hold("r-1", "r-2", "r-3", "r-4")
    await wait_until(lambda: len(peers["i-0"].calls) >= 3, 10, "refused calls")
    with pytest.raises(ResourceExhausted, match="source instance i-0 is busy: this instance already runs"):
        await client.migrate(request_id="r-4", dst_instance_id="i-1")  # the operator is told, as before
    assert (await client.list_migrations()).migrations == []
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'ferry_manager_migration_failures_total{reason="RESOURCE_EXHAUSTED"}' not in text
    assert float(re.search(r'ferry_manager_migrations_source_busy_total\{trigger="load"\} (\S+)', text)[1]) >= 3
    assert 'ferry_manager_migrations_source_busy_total{trigger="admin"} 1.0' in text
    peers["i-0"].is_busy = False  # a failure would hold the pair back for 60 s
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 2}), 10, "moved once the slot was free")
    assert {m.outcome for m in (await client.list_migrations()).migrations} == {"committed"}


async def test_a_drains_next_move_passes_over_the_destination_its_move_in_flight_filled(world):
    """--migration-max-per-instance 2: the freest destination, with one migration slot free, took the drain's first
    move; its reports did not show it yet, and the next tick sent the second there too (refused). The manager
    counts a migration it started in its destination's load (a batch slot, a migration slot, blocks) until a
    report shows it or it ends: the second goes to the next-freest instance."""
    _, client, peers = await world(3, "--migration-max-per-instance", "2", "--migration-failure-backoff-s", "60")
    peers["i-1"].sim.num_free_migration_out_slots = 1  # (its reports never show a migration in: as if all came
    # before its PrepareMigrateIn)
    peers["i-2"].hold("r-x")
    peers["i-0"].hold("r-1", "r-2")
    peers["i-0"].gate = asyncio.Event()  # the drain's moves hang until it is set
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 0, "i-2": 1}), 5, "requests reported")
    await client.drain("i-0")
    await wait_until(lambda: len(peers["i-0"].calls) >= 2, 10, "two moves under way")
    await asyncio.sleep(0.5)  # (ticks every 0.05 s while a drain moves)
    assert [call.dst_instance_id for call in peers["i-0"].calls] == ["i-1", "i-2"]
    peers["i-0"].gate.set()
    await wait_until(lambda: _is_drained(client, "i-0"), 15, "i-0 drained")
    assert {m.outcome for m in (await client.list_migrations()).migrations} == {"committed"}


async def test_the_loop_asks_no_source_that_reports_no_free_migration_slot(world):
    _, client, peers = await world(2, "--migration-enabled", "--migration-threshold", "0")
    peers["i-0"].sim.num_free_migration_out_slots = 0
    peers["i-0"].hold("r-1", "r-2")
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 0}), 5, "requests reported")
    await asyncio.sleep(1.0)  # ten ticks
    assert peers["i-0"].calls == []
    peers["i-0"].sim.num_free_migration_out_slots = 1
    await wait_until(lambda: _running_is(client, {"i-0": 1, "i-1": 1}), 10, "moved once a slot was free")


async def test_the_loop_sends_nothing_to_a_destination_that_reports_no_free_migration_slot(world):
    """Its migration slots (one pool for migrations in and out) were busy with its own migrations: the loop picked it
    all the same, its PrepareMigrateIn was refused, the migration recorded failed and the pair backed off. An admin
    Migrate naming it is still tried, and its refusal names it."""
    _, client, peers = await world(3, "--migration-enabled", "--migration-threshold", "0",
                                   "--migration-failure-backoff-s", "3")
    peers["i-1"].sim.num_free_migration_out_slots = 0  # the freest, and busy
    peers["i-0"].hold("r-1", "r-2", "r-3", "r-4")
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 0, "i-2": 2}), 10, "moved to the free one")
    assert {call.dst_instance_id for call in peers["i-0"].calls} == {"i-2"}
    assert {m.outcome for m in (await client.list_migrations()).migrations} == {"committed"}
    with pytest.raises(ResourceExhausted, match="destination instance i-1 refused the migration: .*it reported no "
                       "free migration slot"):
        await client.migrate(request_id=peers["i-0"].request_ids[0], dst_instance_id="i-1")
    assert peers["i-0"].calls[-1].dst_instance_id == "i-1"  # tried
    peers["i-1"].sim.num_free_migration_out_slots = None  # an older instance: not known, not ruled out (once the
    # pair's backoff after the refusal ends)
    await wait_until(lambda: peers["i-1"].request_ids, 15, "moved to the instance that no longer says it is busy")


async def test_a_source_busy_refusal_is_marked_by_the_instance_itself():
    """The real instance side: a MigrateOut that finds the source's migration slots taken (its PD hand-off)
    comes back over gRPC as SourceBusy, not as a plain RESOURCE_EXHAUSTED like a destination's refusal."""
    slots = MigrationSlots(1)
    slots.acquire("a-pd-handoff")
    settings = MigrationSettings(instance_id="a", transfer_backend=None, stage_blocks=2, max_stages=3,
                                 is_checksum_verified=True, rpc_timeout_s=1.0, transfer_timeout_s=1.0,
                                 reservation_timeout_s=5.0)
    servicer = InstanceServicer(runner=None)
    servicer.migrations = MigrationDriver(None, settings, slots, lambda address: None, object())
    server = await start_grpc_server("127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                       servicer)], ["ferry.v1.InstanceService"])
    channels = InstanceChannels()
    try:
        order = MigrationOrder(InstanceId("a"), server.address, InstanceId("b"), "127.0.0.1:1", MigrationTrigger.PD)
        with pytest.raises(SourceBusy, match="source instance a is busy: .*--max-concurrent-migrations 1"):
            await channels.migrate_out(order, timeout_s=5)
    finally:
        await channels.close()
        await server.stop(0)


async def test_a_migrate_out_running_when_the_manager_stops_is_kept_unknown(world, etcd_client, cluster):
    """It was cancelled and never recorded: the source runs it on, so the history lost a migration."""
    manager, client, peers = await world(2, "--migration-enabled", "--migration-threshold", "0")
    peers["i-0"].hang_s = 60.0
    peers["i-0"].hold("r-1", "r-2")
    await wait_until(lambda: peers["i-0"].calls, 10, "a MigrateOut under way")
    started = asyncio.get_running_loop().time()
    assert await manager.stop() == 0
    assert asyncio.get_running_loop().time() - started < 8.0
    (stored,) = await _stored_migrations(etcd_client, cluster)
    assert (stored.outcome, stored.reason, stored.src_instance_id, stored.trigger) == (
        "unknown", "CANCELLED", "i-0", "load")
    assert "this manager stopped while MigrateOut ran" in stored.message


async def test_a_migrate_out_that_ends_within_the_shutdown_grace_keeps_its_outcome(world, etcd_client, cluster):
    manager, client, peers = await world(2, "--shutdown-grace-s", "5")
    peers["i-0"].hold("r-1")
    await wait_until(lambda: _running_is(client, {"i-0": 1, "i-1": 0}), 5, "request reported")
    peers["i-0"].gate = asyncio.Event()
    migrating = asyncio.create_task(client.migrate(request_id="r-1", dst_instance_id="i-1"))
    await wait_until(lambda: peers["i-0"].calls, 5, "MigrateOut under way")
    stopping = asyncio.create_task(manager.stop())
    await wait_until(lambda: "manager_stopping" in manager.log_path.read_text(), 5, "the manager stopping")
    peers["i-0"].gate.set()
    assert (await migrating).request_id == "r-1"  # the operator's Migrate is answered, not cut
    assert await stopping == 0
    assert [(m.request_id, m.outcome) for m in await _stored_migrations(etcd_client, cluster)] == [
        ("r-1", "committed")]


async def test_a_migration_that_ends_after_its_manager_lost_the_lead_is_not_journaled(world, etcd_client, cluster):
    """The record of a term that ended belongs to the history the new leader keeps: only a migration begun in the
    current term is written (as the settling of unanswered ones already was)."""
    manager, client, peers = await world(2, "--lease-ttl-s", "3")
    peers["i-0"].hold("r-1", "r-2")
    await wait_until(lambda: _running_is(client, {"i-0": 2, "i-1": 0}), 5, "requests reported")
    peers["i-0"].gate = asyncio.Event()
    migrating = asyncio.create_task(client.migrate(request_id="r-1", dst_instance_id="i-1"))
    await wait_until(lambda: peers["i-0"].calls, 5, "MigrateOut under way")
    await etcd_client.kv.delete(leader_key(cluster))  # an operator's etcdctl del: the term ends
    await wait_until(lambda: "leadership_lost" in manager.log_path.read_text(), 10, "the lead lost")
    peers["i-0"].gate.set()
    assert (await migrating).request_id == "r-1"
    await wait_until(lambda: _leads(manager), 10, "leading again, in a new term")
    await client.migrate(request_id="r-2", dst_instance_id="i-1")  # the journal works: this one is written
    await wait_until(lambda: _stored_migrations(etcd_client, cluster), 5, "a record stored")
    await asyncio.sleep(0.5)
    assert [m.request_id for m in await _stored_migrations(etcd_client, cluster)] == ["r-2"]


async def _stored_migrations(etcd_client: Etcd3Client, cluster: str) -> list[manager_pb2.MigrationRecord]:
    prefix = f"/ferry/{cluster}/migrations/"
    reply = await etcd_client.kv.get(prefix, range_end=prefix_range_end(prefix))
    return [manager_pb2.MigrationRecord.FromString(kv.value) for kv in reply.kvs]
