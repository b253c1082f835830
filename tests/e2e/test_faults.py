"""Faults a cluster must survive (issue 6), one test each, with real processes and a real etcd.

Every request streams with `ignore_eos`, greedy or seeded, so its token ids must equal
what one local engine produces, whatever was killed meanwhile. After each fault the
surviving instances' free KV blocks must be back to what they were before it. Tests
run in file order on one cluster (3 instances, 2 managers, 1 transfer service, 2
frontends); each restarts what it killed, except the last (the frontend).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from services.common.gen.ferry.v1 import manager_pb2
from services.common.grpc_server import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S
from services.transfer.client import TransferClient
from tests.e2e.conftest import wait_for
from tests.e2e.fault_cluster import FaultCluster, FaultTimings, Reference, Stream, client_session, wait_for_tokens
from tests.e2e.fault_cluster import fault_reference  # noqa: F401 (the module's `reference` fixture)

pytestmark = pytest.mark.timeout(240)

VICTIM = "instance-0"  # `flood` dispatch sends every request to the first serving instance by id
REREGISTER_TIMEOUT_S = 30.0
MEMBERSHIP_FRESH_S = 6.0  # a view is confirmed at least every resync interval (5 s), plus one read
MEMBERSHIP_RECOVERY_S = 10.0  # its retries while etcd is away back off up to 2 s (a read can take 2 s)
ETCD_DOWN_S = float(os.environ.get("FERRY_TEST_ETCD_DOWN_S", "5"))  # the full 10 s: test_etcd_down_for_10_s
TIMINGS = FaultTimings(instance_lease_ttl_s=2.0, manager_lease_ttl_s=3.0, transfer_lease_ttl_s=2.0)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with FaultCluster(tiny_model_dir, tmp_path_factory.mktemp("faults"), num_instances=3, num_managers=2,
                      timings=TIMINGS).running() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def second_frontend(cluster):
    """A second frontend that never resumes (--max-resumes 0)."""
    return asyncio.run(cluster.start_frontend("frontend-1", "--max-resumes", "0"))


@pytest.fixture
async def session():
    async with client_session() as session:
        yield session


HELD_BACK = ("\x1fnever in the text",)  # holds back 17 characters: a resume must not lose (or repeat) them
CONSTRAINED = "[a-z ,.]{20000}"  # longer than any answer here: never complete


def mixed_streams(tag: str, num: int, max_tokens: int, stop: tuple[str, ...] = ()) -> list[Stream]:
    """Half greedy, half seeded sampling."""
    return [Stream(f"{tag} request {n} says", max_tokens, *((0.0, None) if n % 2 == 0 else (0.8, 1000 + n)),
                   stop=stop) for n in range(num)]


def run_streams(session, cluster: FaultCluster, streams: list[Stream], url: str | None = None) -> list[asyncio.Task]:
    return [asyncio.create_task(s.run(session, url or cluster.frontend_url, cluster.model_name)) for s in streams]


@contextlib.contextmanager
def frozen(process) -> Iterator[None]:
    """`process` SIGSTOPped for the block (its sockets stay open, nothing answers), SIGCONTed after."""
    process.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.signal(signal.SIGCONT)


def assert_identical(streams: list[Stream], reference: Reference) -> None:
    for stream, (tokens, text) in zip(streams, reference.outputs(streams)):
        assert stream.is_ok, (stream.request_id, stream.error)
        assert stream.token_ids == tokens, f"{stream.request_id}: tokens differ from the reference"
        assert stream.text == text, f"{stream.request_id}: text differs from the reference"


async def test_instance_killed_mid_stream_greedy_and_seeded_continue_identically(session, cluster, reference):
    await cluster.set_policy(dispatch="flood", migration_enabled=False)
    survivors = [n for n in cluster.names("instance") if n != VICTIM]
    baseline = await cluster.free_blocks(survivors)
    resumes_before = await cluster.metric(cluster.frontend_url, "ferry_frontend_stream_resumes_total")
    streams = mixed_streams("killed", 6, 900, stop=HELD_BACK)  # long: still running when the kill lands
    streams += [Stream(f"killed constrained {n} says", 900, *sampling, stop=HELD_BACK, guided_regex=CONSTRAINED)
                for n, sampling in enumerate([(0.0, None), (0.8, 77)])]  # the grammar's state is rebuilt on resume
    tasks = run_streams(session, cluster, streams)
    await wait_for_tokens(streams, 8)
    on_victim = await cluster.admin("ListRequests", manager_pb2.AdminListRequestsRequest(instance_id=VICTIM))
    cluster.kill(VICTIM)
    try:
        await asyncio.gather(*tasks)
        assert_identical(streams, reference)
        resumes = await cluster.metric(cluster.frontend_url, "ferry_frontend_stream_resumes_total") - resumes_before
        assert len(on_victim.requests) <= resumes <= 2 * len(streams)  # each request it had resumed once or twice
        await cluster.wait_blocks_back(baseline)
    finally:
        await cluster.restart(VICTIM)  # the tests after this one need it, whatever happened here


async def test_instance_frozen_mid_stream_streams_finish_elsewhere_while_it_stays_frozen(session, cluster, reference):
    """A hung instance (SIGSTOP: its sockets stay open, nothing answers) is found by the
    keepalive pings, not by a closed socket: its streams, and new requests dispatched to it
    before the manager noticed, resume elsewhere while it is still frozen. Once it runs
    again it drops the orphaned requests (their streams are gone) and frees every block."""
    await cluster.set_policy(dispatch="flood", migration_enabled=False)
    baseline = await cluster.free_blocks()
    streams = mixed_streams("frozen", 6, 160)
    tasks = run_streams(session, cluster, streams)
    await wait_for_tokens(streams, 8)
    with frozen(cluster.process(VICTIM)):
        late = mixed_streams("dispatched to the frozen instance", 2, 40)
        tasks += run_streams(session, cluster, late)
        # Without pings each would wait for its 600 s deadline (or gRPC's 60 s ping timeout).
        await asyncio.wait_for(asyncio.gather(*tasks), KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S + 20)
    assert_identical(streams + late, reference)
    await cluster.wait_blocks_back(baseline)


async def test_beyond_max_resumes_the_client_gets_an_error_event(session, cluster, reference, second_frontend):
    await cluster.set_policy(dispatch="flood", migration_enabled=False)
    await cluster.free_blocks()  # the restarted victim reports again
    survivors = [n for n in cluster.names("instance") if n != VICTIM]
    baseline = await cluster.free_blocks(survivors)
    stream = Stream("a request that runs out of resumes", 900)
    task, = run_streams(session, cluster, [stream], second_frontend.address)
    await wait_for_tokens([stream], 8)
    cluster.kill(VICTIM)
    await task
    assert stream.finish_reason is None and stream.error and "--max-resumes 0" in stream.error
    assert stream.num_done_markers == 1  # an explicit end, not a silent one
    assert stream.token_ids == reference.tokens([stream])[0][:len(stream.token_ids)]
    await cluster.wait_blocks_back(baseline)
    await cluster.restart(VICTIM)


async def test_transfer_service_killed_mid_migration_request_finishes_on_the_source(session, cluster, reference):
    await cluster.set_policy(dispatch="flood", migration_enabled=False)
    baseline = await cluster.free_blocks()
    stream = Stream("a request whose migration fails", 300)
    task, = run_streams(session, cluster, [stream])
    await wait_for_tokens([stream], 8)
    transfer = cluster.process("transfer-0")
    transfer.signal(signal.SIGSTOP)  # the first copy stage hangs in it ...
    migrate = asyncio.create_task(cluster.admin("Migrate", manager_pb2.MigrateRequest(
        request_id=stream.request_id, dst_instance_id="instance-1"), timeout_s=60))
    await asyncio.sleep(1.0)
    cluster.kill("transfer-0")  # ... and it dies mid-copy
    with pytest.raises(grpc.aio.AioRpcError):
        await migrate
    await task
    assert_identical([stream], reference)
    await cluster.wait_blocks_back(baseline)  # the destination's reservation is freed too
    await cluster.restart("transfer-0")
    # the restarted service has no mappings: the instances map their KV memory again by themselves
    await _wait_mapped(cluster, cluster.names("instance"))
    moved = Stream("a request that migrates after the restart", 900)  # still running when Migrate looks for it
    task, = run_streams(session, cluster, [moved])
    await wait_for_tokens([moved], 8)
    assert moved.error is None and moved.request_id, moved.error
    answer = await cluster.admin("Migrate", manager_pb2.MigrateRequest(request_id=moved.request_id,
                                                                      dst_instance_id="instance-1"))
    await task
    assert answer.dst_instance_id == "instance-1" and answer.num_blocks > 0
    assert_identical([moved], reference)
    await cluster.wait_blocks_back(baseline)


async def _wait_mapped(cluster: FaultCluster, instance_ids: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with TransferClient(cluster.process("transfer-0").address) as transfer:
        while set(instance_ids) - set((await transfer.get_status()).instance_ids):
            assert time.monotonic() < deadline, f"{instance_ids} not mapped again after {timeout_s} s"
            await asyncio.sleep(0.2)


async def test_leader_manager_killed_zero_failed_requests(session, cluster, reference):
    await cluster.set_policy(dispatch="load", migration_enabled=False)
    baseline = await cluster.free_blocks()
    leader = await cluster.leader()
    in_flight = mixed_streams("in flight during failover", 6, 120)
    tasks = run_streams(session, cluster, in_flight)
    await wait_for_tokens(in_flight, 4)
    killed_at = time.monotonic()
    cluster.kill(leader)

    async def elected() -> tuple[str, float]:
        return await cluster.leader(), time.monotonic() - killed_at
    election = asyncio.create_task(elected())
    during: list[Stream] = []
    for wave in range(8):  # new requests all through the failover
        during += mixed_streams(f"sent during failover wave {wave}", 2, 24)
        tasks += run_streams(session, cluster, during[-2:])
        await asyncio.sleep(0.5)
    new_leader, took_s = await election
    await asyncio.gather(*tasks)
    assert new_leader != leader and took_s < TIMINGS.manager_lease_ttl_s + 5, took_s
    assert_identical(in_flight + during, reference)
    await cluster.wait_blocks_back(baseline)  # every instance streams its load to the new leader
    await cluster.restart(leader)  # back as a standby


async def test_leader_manager_frozen_then_resumed_steps_down(session, cluster, reference):
    """A leader frozen past its lease TTL is replaced; when it runs again it finds its lease
    gone and serves as a standby: one leader, no failed request, no process restarted."""
    await cluster.set_policy(dispatch="load", migration_enabled=True)
    baseline = await cluster.free_blocks()
    pids = cluster.pids()
    leader = await cluster.leader()
    in_flight = mixed_streams("in flight while the leader is frozen", 6, 120)
    tasks = run_streams(session, cluster, in_flight)
    await wait_for_tokens(in_flight, 4)
    with frozen(cluster.process(leader)):
        during: list[Stream] = []
        started = time.monotonic()
        while time.monotonic() - started < TIMINGS.manager_lease_ttl_s + 3:
            during += mixed_streams(f"sent while the leader is frozen {len(during)}", 2, 24)
            tasks += run_streams(session, cluster, during[-2:])
            await asyncio.sleep(0.5)
        new_leader = await cluster.leader()
    assert new_leader != leader
    after = mixed_streams("sent after the old leader woke up", 4, 24)
    tasks += run_streams(session, cluster, after)
    await asyncio.gather(*tasks)
    assert_identical(in_flight + during + after, reference)

    async def one_leader() -> bool:
        views = [await cluster.cluster_status(cluster.process(name).address) for name in cluster.names("manager")]
        return all(v.leader_id == new_leader for v in views) or None
    await wait_for(one_leader, 10, "both managers name the new leader")
    assert cluster.dead() == [] and cluster.pids() == pids
    await cluster.set_policy(migration_enabled=False)
    await cluster.wait_blocks_back(baseline)


async def test_every_manager_killed_requests_keep_flowing_by_local_dispatch(session, cluster, reference):
    """The control plane is not on the data path: with no manager at all, frontends place
    requests themselves and running streams never notice; a restarted manager leads again."""
    await cluster.set_policy(dispatch="load", migration_enabled=False)
    baseline = await cluster.free_blocks()
    fallbacks_before = await cluster.metric(cluster.frontend_url, "ferry_frontend_dispatch_fallbacks_total")
    in_flight = mixed_streams("in flight when the managers die", 4, 120)
    tasks = run_streams(session, cluster, in_flight)
    await wait_for_tokens(in_flight, 4)
    managers = cluster.names("manager")
    for name in managers:
        cluster.kill(name)
    during = mixed_streams("sent with no manager", 8, 24)
    tasks += run_streams(session, cluster, during)
    await asyncio.gather(*tasks)
    assert_identical(in_flight + during, reference)
    fallbacks = await cluster.metric(cluster.frontend_url, "ferry_frontend_dispatch_fallbacks_total") - fallbacks_before
    assert fallbacks >= len(during)
    for name in managers:
        await cluster.restart(name)
    await cluster.leader()
    await cluster.wait_blocks_back(baseline)  # the instances stream their load to the new leader


async def _etcd_outage(session, cluster: FaultCluster, reference: Reference, down_s: float, *, is_paused: bool) -> None:
    """etcd unreachable for `down_s` (stopped, or SIGSTOPped: connections hang): nothing fails, nothing restarts."""
    await cluster.set_policy(dispatch="load", migration_enabled=False)
    baseline = await cluster.free_blocks()
    pids = cluster.pids()
    spanning = mixed_streams("spanning the etcd outage", 4, 24 * int(down_s + 4))
    tasks = run_streams(session, cluster, spanning)
    await wait_for_tokens(spanning, 4)
    if is_paused:
        cluster.etcd.pause()
    else:
        cluster.etcd.terminate()
    during: list[Stream] = []
    started = time.monotonic()
    while time.monotonic() - started < down_s:
        during += mixed_streams(f"sent while etcd is down {len(during)}", 2, 16)
        tasks += run_streams(session, cluster, during[-2:])
        await asyncio.sleep(0.5)
    staleness = await cluster.metric(cluster.frontend_url, "ferry_frontend_membership_staleness_seconds")
    if is_paused:
        cluster.etcd.resume()
    else:
        cluster.etcd.start()
    await asyncio.gather(*tasks)
    assert staleness >= down_s - 1, staleness  # it served from the last known membership
    assert_identical(spanning + during, reference)
    assert cluster.dead() == [] and cluster.pids() == pids  # no process exited or restarted
    await cluster.leader()  # a manager leads again

    async def all_registered() -> dict[str, manager_pb2.InstanceInfo] | None:
        infos = await cluster.instances()
        return infos if sorted(infos) == cluster.names("instance") else None
    # every instance registers again, under its own id (a lease renewal backs off up to TTL/3,
    # and the leader's view catches up by watch or by its periodic resync)
    infos = await wait_for(all_registered, REREGISTER_TIMEOUT_S, "every instance registered again")
    assert {i: infos[i].pid for i in infos} == {i: pids[i] for i in infos}
    await cluster.wait_blocks_back(baseline, timeout_s=60)  # and streams its load to the leader

    async def frontend_view_fresh() -> bool:  # re-read within a resync interval (5 s) of etcd's return
        staleness_s = await cluster.metric(cluster.frontend_url, "ferry_frontend_membership_staleness_seconds")
        return staleness_s < MEMBERSHIP_FRESH_S
    await wait_for(frontend_view_fresh, MEMBERSHIP_RECOVERY_S, "the frontend's view of the instances fresh again")
    after = mixed_streams("after the etcd outage", 4, 16)
    await asyncio.gather(*run_streams(session, cluster, after))
    assert_identical(after, reference)


async def test_instance_lease_lost_while_etcd_hangs_keeps_serving_and_reregisters(session, cluster, reference):
    await _etcd_outage(session, cluster, reference, ETCD_DOWN_S, is_paused=True)


async def test_etcd_down_requests_keep_flowing_and_everything_reregisters(session, cluster, reference):
    await _etcd_outage(session, cluster, reference, ETCD_DOWN_S, is_paused=False)


@pytest.mark.slow
async def test_etcd_down_for_10_s(session, cluster, reference):
    await _etcd_outage(session, cluster, reference, 10.0, is_paused=False)


async def test_frontend_killed_other_frontend_keeps_serving(session, cluster, reference, second_frontend):
    """Runs last: frontend-0 stays dead. Its clients' connections drop; frontend-1's are untouched."""
    await cluster.set_policy(dispatch="load", migration_enabled=False)
    await _every_frontend_sees(session, [cluster.frontend_url, second_frontend.address], 3)  # after the outages
    baseline = await cluster.free_blocks()
    on_killed = mixed_streams("on the killed frontend", 3, 900)
    on_other = mixed_streams("on the other frontend", 3, 120)
    tasks = run_streams(session, cluster, on_killed) + run_streams(session, cluster, on_other, second_frontend.address)
    await wait_for_tokens(on_killed + on_other, 8)
    cluster.kill("frontend-0")
    await asyncio.gather(*tasks)
    dropped = [s for s in on_killed if s.error]  # a stream served fast may have ended before the kill
    assert dropped and all(s.error.startswith("connection") for s in dropped), \
        [(s.request_id, s.error, s.finish_reason, len(s.token_ids)) for s in on_killed]
    assert_identical([s for s in on_killed if not s.error], reference)
    assert_identical(on_other, reference)
    await cluster.wait_blocks_back(baseline)  # the instances aborted the dead frontend's requests
    after = mixed_streams("after the frontend died", 2, 16)
    await asyncio.gather(*run_streams(session, cluster, after, second_frontend.address))
    assert_identical(after, reference)


async def _every_frontend_sees(session, frontend_urls: list[str], num_instances: int) -> None:
    async def healthy() -> bool:
        for url in frontend_urls:
            async with session.get(f"{url}/health") as response:
                if response.status != 200 or (await response.json())["num_instances"] != num_instances:
                    return False
        return True
    await wait_for(healthy, 30, f"every frontend serving with {num_instances} instances")
