"""Leader election against a real etcd: one leader, hand-over on resign and on lease loss."""

from __future__ import annotations

import asyncio
import time

import pytest
from etcd3aio import Etcd3Client

from services.common.election import Election, LeaderInfo, watch_leader
from services.common.etcd_launcher import LocalEtcd
from services.common.registry import Registry

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0


@pytest.fixture
async def candidates(etcd: LocalEtcd, cluster: str):
    a = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=TTL_S)
    b = Election([etcd.endpoint], cluster, "m-b", "127.0.0.1:1002", ttl_s=TTL_S)
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture
async def leader_view(etcd: LocalEtcd, cluster: str):
    registry = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    yield await watch_leader(registry)
    await registry.close()


async def test_one_leader_then_hand_over_on_resign(candidates, leader_view) -> None:
    a, b = candidates
    await asyncio.wait_for(a.campaign(), 5)
    assert a.is_leader
    b_campaign = asyncio.create_task(b.campaign())
    await asyncio.sleep(0.5)
    assert not b_campaign.done() and not b.is_leader
    leader = await b.leader()
    assert (leader.leader_id, leader.address) == ("m-a", "127.0.0.1:1001") and leader.epoch == a.epoch
    await asyncio.wait_for(_until(lambda: leader_view.leader is not None), 5)
    assert leader_view.leader == LeaderInfo("m-a", "127.0.0.1:1001")

    await a.resign()
    assert not a.is_leader and not a.lost.is_set()
    await asyncio.wait_for(b_campaign, 3)  # the watch wakes b at once, well within a TTL
    assert b.is_leader and b.epoch > leader.epoch
    assert (await a.leader()).leader_id == "m-b"
    await asyncio.wait_for(_until(lambda: leader_view.leader == LeaderInfo("m-b", "127.0.0.1:1002")), 5)


async def test_leader_whose_lease_is_revoked_steps_down(candidates, etcd: LocalEtcd) -> None:
    a, b = candidates
    await asyncio.wait_for(a.campaign(), 5)
    b_campaign = asyncio.create_task(b.campaign())
    async with Etcd3Client([etcd.endpoint]) as client:
        lease_id = (await client.kv.get(a.key, timeout=5)).kvs[0].lease
        await client.lease.revoke(lease_id, timeout=5)  # a "dies" as far as etcd is concerned
    await asyncio.wait_for(a.lost.wait(), TTL_S + 1)
    assert not a.is_leader
    await asyncio.wait_for(b_campaign, 5)
    assert b.is_leader

    await asyncio.wait_for(b.close(), 5)  # b goes away; a may lead again
    await asyncio.wait_for(a.campaign(), 5)
    assert a.is_leader and not a.lost.is_set()


async def test_leader_frozen_past_its_ttl_knows_at_once_it_may_have_lost(candidates) -> None:
    a, _ = candidates
    await asyncio.wait_for(a.campaign(), 5)
    assert a.holds_lease
    time.sleep(TTL_S + 0.2)  # the whole event loop frozen, as under SIGSTOP: no renewal ran
    assert a.is_leader and not a.holds_lease  # the election does not know yet; the local clock does
    await asyncio.wait_for(a.lost.wait(), TTL_S)  # the next renewal finds the lease expired
    assert not a.is_leader and not a.holds_lease


async def test_no_leader_and_campaign_after_close(candidates) -> None:
    a, _ = candidates
    assert await a.leader() is None
    await asyncio.wait_for(a.campaign(), 5)
    await a.close()
    assert await Election.leader(a) is None


async def test_close_twice_while_etcd_is_away_ends_quietly(candidates, running_etcd: LocalEtcd) -> None:
    """A manager closes its election twice on the way out (its shutdown, then its `finally`). With
    etcd stopped first (`systemctl stop ferry.target` stops every unit at once), the first close could
    not delete the key; the second one called etcd on the closed client: AttributeError, exit 1."""
    a, _ = candidates
    await asyncio.wait_for(a.campaign(), 5)
    running_etcd.terminate()
    await asyncio.wait_for(a.close(), 10)
    await asyncio.wait_for(a.close(), 10)
    assert not a.is_leader


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


async def test_leader_cut_off_from_etcd_notices_and_someone_leads_after(candidates, running_etcd: LocalEtcd) -> None:
    a, b = candidates
    await asyncio.wait_for(a.campaign(), 5)
    b_campaign = asyncio.create_task(b.campaign())
    running_etcd.pause()
    try:
        await asyncio.wait_for(a.lost.wait(), 2 * TTL_S + 1)
        assert not a.is_leader
    finally:
        running_etcd.resume()
    a_campaign = asyncio.create_task(a.campaign())
    done, _ = await asyncio.wait([a_campaign, b_campaign], timeout=3 * TTL_S + 2,
                                 return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and a.is_leader != b.is_leader
    for task in (a_campaign, b_campaign):
        task.cancel()


@pytest.mark.parametrize("how_a_leaves", ["lost", "resigned"])
async def test_a_leader_gone_during_an_etcd_restart_does_not_block_the_next_election(
        etcd: LocalEtcd, cluster: str, running_etcd: LocalEtcd, how_a_leaves: str) -> None:
    """A restarted etcd restores every lease for a fresh TTL, the old leader's key with its own. The
    leader lost its term while etcd was away, or resigned then (a failed term: it could not delete
    its key): its next campaign deletes the key, so someone leads at once, not a TTL later."""
    ttl_s = 6.0
    a = Election([etcd.endpoint], cluster, "m-a", "127.0.0.1:1001", ttl_s=ttl_s)
    b = Election([etcd.endpoint], cluster, "m-b", "127.0.0.1:1002", ttl_s=ttl_s)
    try:
        await asyncio.wait_for(a.campaign(), 5)
        b_campaign = asyncio.create_task(b.campaign())
        running_etcd.terminate()
        if how_a_leaves == "lost":
            await asyncio.wait_for(a.lost.wait(), 2 * ttl_s)
        else:
            await a.resign()
        await running_etcd.start_async()  # from this thread: PR_SET_PDEATHSIG follows the thread that spawned it
        back_at = time.monotonic()
        a_campaign = asyncio.create_task(a.campaign())
        done, _ = await asyncio.wait([a_campaign, b_campaign], timeout=ttl_s, return_when=asyncio.FIRST_COMPLETED)
        assert done and time.monotonic() - back_at < 0.75 * ttl_s, "no leader until the restored lease ran out"
        assert a.is_leader != b.is_leader
        for task in (a_campaign, b_campaign):
            task.cancel()
    finally:
        await a.close()
        await b.close()


async def test_a_leader_whose_key_was_deleted_and_taken_by_another_steps_down(candidates, etcd: LocalEtcd) -> None:
    """An operator deleted the leader key (`etcdctl del`) while the leader's lease lived on: a standby took the
    key, and the old leader, renewing its lease and never reading its key, led on too (two leaders). It now
    checks its key each renewal and steps down once the key is gone or another's."""
    a, b = candidates
    await asyncio.wait_for(a.campaign(), 5)
    b_campaign = asyncio.create_task(b.campaign())
    async with Etcd3Client([etcd.endpoint]) as client:
        await client.kv.delete(a.key, timeout=5)
    await asyncio.wait_for(b_campaign, 5)
    assert b.is_leader
    await asyncio.wait_for(a.lost.wait(), TTL_S + 1)
    assert not a.is_leader and b.is_leader


async def test_a_leader_whose_key_was_deleted_revokes_its_lease(candidates, etcd: LocalEtcd) -> None:
    """A leader that stepped down because its key was gone (`key_lost`) left its lease, renewed until then, to
    run out: it held nothing for a TTL. It is revoked at once now, after the step-down."""
    a, _ = candidates
    await asyncio.wait_for(a.campaign(), 5)
    lease_id = a._lease.lease_id
    async with Etcd3Client([etcd.endpoint]) as client:
        await client.kv.delete(a.key, timeout=5)
        await asyncio.wait_for(a.lost.wait(), TTL_S + 1)
        ttls: list[int] = []
        deadline = time.monotonic() + TTL_S / 4  # well before the lease, renewed just before, could run out
        while time.monotonic() < deadline and (not ttls or ttls[-1] != -1):
            ttls.append((await client.lease.time_to_live(lease_id, timeout=5)).TTL)
            await asyncio.sleep(0.05)
    assert ttls[-1] == -1, f"the old lease lives on, TTL {ttls[-1]} s"
    assert not a.is_leader
