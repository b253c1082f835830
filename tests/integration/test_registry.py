"""Registry and MembershipView against a real etcd: registration, watches, lease loss, outages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest
from etcd3aio import Etcd3Client
from structlog.testing import capture_logs

from services.common.errors import FailedPrecondition, Unavailable
from services.common.etcd_launcher import LocalEtcd, free_port
from services.common.registry import Registry
from tests.integration.eventually import eventually

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0


@pytest.fixture
async def registries(etcd: LocalEtcd, cluster: str):
    """Two registries on the same cluster: `member` registers, `observer` watches."""
    member = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    observer = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    yield member, observer
    await member.close()
    await observer.close()


@pytest.fixture
async def raw_etcd(etcd: LocalEtcd):
    async with Etcd3Client([etcd.endpoint]) as client:
        yield client


async def test_register_watch_update_close(registries) -> None:
    member, observer = registries
    view = await observer.watch("instances", resync_interval_s=1.0)
    assert view.members == {} and view.staleness_s < 1.0

    version = view.version
    await member.register("instances", "i-1", {"address": "127.0.0.1:1", "role": "both"})
    assert member.is_registered and member.lease_id is not None
    change = await asyncio.wait_for(view.changed(since=version), 5)
    assert change.added == {"i-1"} and view.get("i-1") == {"address": "127.0.0.1:1", "role": "both"}

    seen = []
    view.on_change(seen.append)
    version = view.version
    await member.update("instances", "i-1", {"address": "127.0.0.1:1", "role": "decode"})
    change = await asyncio.wait_for(view.changed(since=version), 5)
    assert change.updated == {"i-1"} and view.get("i-1")["role"] == "decode"
    assert seen and seen[-1].updated == {"i-1"}

    version = view.version
    await member.close()  # revokes the lease: the key goes at once, not after the TTL
    change = await asyncio.wait_for(view.changed(since=version), 5)
    assert change.removed == {"i-1"} and view.members == {}


async def test_two_kinds_are_separate(registries) -> None:
    member, observer = registries
    await member.register("instances", "i-1", {"n": 1})
    await member.register("transfer", "t-1", {"n": 2})
    instances = await observer.watch("instances")
    transfer = await observer.watch("transfer")
    assert dict(instances.members) == {"i-1": {"n": 1}}
    assert dict(transfer.members) == {"t-1": {"n": 2}}
    version = transfer.version
    await member.unregister("transfer", "t-1")
    await asyncio.wait_for(transfer.changed(since=version), 5)
    assert transfer.members == {} and "i-1" in instances.members


async def test_revoked_lease_is_reregistered_under_the_same_id(registries, raw_etcd: Etcd3Client) -> None:
    member, observer = registries
    states = []
    member.on_registration_change(states.append)
    await member.register("instances", "i-1", {"address": "a"})
    view = await observer.watch("instances")
    old_lease = member.lease_id

    await raw_etcd.lease.revoke(old_lease, timeout=5)  # behind the registry's back
    await eventually(lambda: member.num_reregistrations == 1, what="re-registration")
    assert member.is_registered and member.lease_id != old_lease
    assert states == [True, False, True]
    await eventually(lambda: view.get("i-1") == {"address": "a"}, what="key back in the view")
    response = await raw_etcd.kv.get(member.key("instances", "i-1"), timeout=5)
    assert response.kvs[0].lease == member.lease_id


async def test_a_process_back_after_its_lease_expired_leaves_its_id_to_the_one_that_took_it(
        etcd: LocalEtcd, cluster: str, registries, raw_etcd: Etcd3Client) -> None:
    """An instance frozen past its lease (a hung host), a replacement started with the same id, then the
    old one resumed: it re-registered over the replacement, so two processes answered to one id (the
    manager routed to the old one, the transfer service mapped the new one's KV memory). It now stays
    unregistered while the id is another's, and takes it back once that one leaves (black-box run)."""
    old, _ = registries
    async with _replaced_while_frozen(old, etcd, cluster, raw_etcd, "instances", "i-1") as replacement:
        await eventually(lambda: not old.is_registered, what="the old one noticing its lease expired")
        await asyncio.sleep(2 * TTL_S)  # several keepalive rounds of the old one
        response = await raw_etcd.kv.get(old.key("instances", "i-1"), timeout=5)
        assert json.loads(response.kvs[0].value) == {"address": "new"} and not old.is_registered
        assert response.kvs[0].lease == replacement.lease_id
    await eventually(lambda: old.is_registered, what="the old one back once the id is free")
    response = await raw_etcd.kv.get(old.key("instances", "i-1"), timeout=5)
    assert json.loads(response.kvs[0].value) == {"address": "old"} and response.kvs[0].lease == old.lease_id


async def test_an_unregister_after_the_lease_expired_leaves_the_id_to_the_process_that_took_it(
        etcd: LocalEtcd, cluster: str, registries, raw_etcd: Etcd3Client) -> None:
    """A frontend frozen past its lease, a replacement registered under its id, then the old one stopped: its
    unregister deleted the replacement's record, so the id was out of every view while the replacement served.
    Only a key under our own lease is deleted now."""
    old, _ = registries
    async with _replaced_while_frozen(old, etcd, cluster, raw_etcd, "frontends", "f-1") as replacement:
        await old.unregister("frontends", "f-1")
        response = await raw_etcd.kv.get(old.key("frontends", "f-1"), timeout=5)
        assert response.kvs, "the old process deleted the replacement's record"
        assert response.kvs[0].lease == replacement.lease_id


@contextlib.asynccontextmanager
async def _replaced_while_frozen(old: Registry, etcd: LocalEtcd, cluster: str, raw_etcd: Etcd3Client, kind: str,
                                 member_id: str) -> AsyncIterator[Registry]:
    """`old` registered under the id, its lease expired while it was frozen (its keepalive held: nothing of it ran
    between the expiry and the replacement), and a replacement registered under the id meanwhile: its registry."""
    await old.register(kind, member_id, {"address": "old"})
    replacement = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    try:
        async with old._lock:
            await raw_etcd.lease.revoke(old.lease_id, timeout=5)  # expired while the old one was frozen
            await replacement.register(kind, member_id, {"address": "new"})
        yield replacement
    finally:
        await replacement.close()


async def test_an_id_a_live_process_holds_is_refused_not_taken(etcd: LocalEtcd, cluster: str, registries,
                                                             raw_etcd: Etcd3Client) -> None:
    """Two live processes started with one id: the second one's put overwrote the first's record, and the
    first, still renewing its own lease and sure it was registered, reported load under the id the record
    gave another address (found by a test race). The second now waits out the holder's lease and then
    refuses to start, naming the holder; the first keeps its record."""
    first, _ = registries
    await first.register("instances", "i-1", {"address": "127.0.0.1:1"})
    second = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(FailedPrecondition, match=r"i-1 is registered by another live process \(at 127.0.0.1:1\)"):
            await second.register("instances", "i-1", {"address": "127.0.0.1:2"})
        assert asyncio.get_running_loop().time() - started >= TTL_S  # it gave the holder a lease's time to go
        response = await raw_etcd.kv.get(first.key("instances", "i-1"), timeout=5)
        assert json.loads(response.kvs[0].value) == {"address": "127.0.0.1:1"}
        assert response.kvs[0].lease == first.lease_id and first.is_registered
    finally:
        await second.close()


async def test_an_id_held_by_a_process_that_stopped_is_taken_once_its_lease_runs_out(
        etcd: LocalEtcd, cluster: str, raw_etcd: Etcd3Client) -> None:
    """A crashed process's record outlives it by one TTL: its restart on another port waits for it; one on
    the same address is the predecessor's own socket (no live process shares a port) and takes it at once."""
    key_of = Registry([etcd.endpoint], cluster).key
    for member_id, address in (("i-1", "127.0.0.1:1"), ("i-2", "127.0.0.1:3")):
        lease = await raw_etcd.lease.grant(ttl=2, timeout=5)  # a process that died: nobody renews it
        await raw_etcd.kv.put(key_of("instances", member_id), json.dumps({"address": address}), lease=lease.ID,
                              timeout=5)
    restarted = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    try:
        started = asyncio.get_running_loop().time()
        await restarted.register("instances", "i-2", {"address": "127.0.0.1:3"})  # same address: at once
        assert asyncio.get_running_loop().time() - started < 1.0
        await restarted.register("instances", "i-1", {"address": "127.0.0.1:2"})  # another port: after the TTL
        assert asyncio.get_running_loop().time() - started >= 1.0
        for member_id, address in (("i-1", "127.0.0.1:2"), ("i-2", "127.0.0.1:3")):
            response = await raw_etcd.kv.get(key_of("instances", member_id), timeout=5)
            assert json.loads(response.kvs[0].value) == {"address": address}
            assert response.kvs[0].lease == restarted.lease_id
    finally:
        await restarted.close()


async def test_a_process_frozen_past_its_ttl_is_unregistered_the_moment_it_runs_again(registries,
                                                                                     raw_etcd: Etcd3Client) -> None:
    """A process frozen (SIGSTOP, a stalled VM) past its lease TTL counted itself registered, and sent load reports
    under its id (another process's by then, maybe), until its next renewal came back. Like a leader's
    `holds_lease`, `is_registered` now also asks the local clock: False from the first moment it runs again."""
    member, _ = registries
    states = []
    member.on_registration_change(states.append)
    await member.register("instances", "i-1", {"address": "127.0.0.1:1"})
    old_lease = member.lease_id
    time.sleep(TTL_S + 0.5)  # the whole event loop frozen: no renewal ran
    assert not member.is_registered, "a process frozen past its lease counted itself registered"
    await eventually(lambda: member.is_registered, what="registered again")
    assert states == [True, False, True] and member.lease_id != old_lease
    response = await raw_etcd.kv.get(member.key("instances", "i-1"), timeout=5)
    assert response.kvs[0].lease == member.lease_id


async def test_a_first_registration_waiting_out_a_dead_holders_lease_keeps_its_own(
        etcd: LocalEtcd, cluster: str, raw_etcd: Etcd3Client) -> None:
    """A process restarted on another port under the id of one that crashed, as its first registration: it waits out
    the dead one's lease (its TTL and a second), and no keepalive loop ran yet to renew its own, which had expired
    by then: the put failed ('requested lease not found') and it exited with Unavailable naming etcd. Its lease is
    renewed while it waits now."""
    key = Registry([etcd.endpoint], cluster).key("instances", "i-1")
    lease = await raw_etcd.lease.grant(ttl=int(TTL_S) + 1, timeout=5)  # the crashed one's (as long as ours, or longer)
    await raw_etcd.kv.put(key, json.dumps({"address": "127.0.0.1:1"}), lease=lease.ID, timeout=5)
    restarted = Registry([etcd.endpoint], cluster, ttl_s=TTL_S)
    try:
        assert await restarted.register("instances", "i-1", {"address": "127.0.0.1:2"})
        response = await raw_etcd.kv.get(key, timeout=5)
        assert json.loads(response.kvs[0].value) == {"address": "127.0.0.1:2"}
        assert response.kvs[0].lease == restarted.lease_id and restarted.is_registered
    finally:
        await restarted.close()


async def test_paused_etcd_loses_registration_then_it_comes_back(registries, running_etcd: LocalEtcd) -> None:
    member, observer = registries
    await member.register("instances", "i-1", {"address": "a"})
    view = await observer.watch("instances", resync_interval_s=1.0)
    assert view.get("i-1") == {"address": "a"}

    running_etcd.pause()
    try:
        await eventually(lambda: not member.is_registered, timeout_s=3 * TTL_S + 2, what="lease loss noticed")
        await eventually(lambda: view.staleness_s > TTL_S, what="staleness growing")
        assert view.get("i-1") == {"address": "a"}  # last known members are kept
    finally:
        running_etcd.resume()

    await eventually(lambda: member.is_registered, timeout_s=15, what="re-registration")
    assert member.num_reregistrations == 1
    await eventually(lambda: view.staleness_s < 1.5, what="view fresh again")
    await eventually(lambda: view.get("i-1") == {"address": "a"}, what="member visible")


async def test_etcd_restart_is_survived(registries, running_etcd: LocalEtcd) -> None:
    member, observer = registries
    await member.register("instances", "i-1", {"address": "a"})
    view = await observer.watch("instances", resync_interval_s=1.0)

    running_etcd.terminate()
    await asyncio.sleep(1.0)
    assert view.get("i-1") == {"address": "a"}
    await running_etcd.start_async()

    await member.update("instances", "i-1", {"address": "b"})
    await eventually(lambda: view.get("i-1") == {"address": "b"}, timeout_s=15, what="update seen after restart")
    # The watch can deliver the re-registration's put before the put's own reply reaches the registry.
    await eventually(lambda: member.is_registered, timeout_s=5, what="registered again")


async def test_an_update_while_the_registry_closes_against_a_stopped_etcd(registries, running_etcd: LocalEtcd) -> None:
    """A transfer service stopping with etcd (`systemctl stop ferry.target` stops every unit at once)
    while an instance unmaps itself: the update waits for the close and is dropped. It used to put
    on the channel close() had just closed: UsageError, a traceback in the transfer's log."""
    member, _ = registries
    await member.register("transfer", "t-1", {"instances": ["a"]})
    running_etcd.terminate()
    closing = asyncio.create_task(member.close())
    await asyncio.sleep(0.05)  # close() is revoking the lease, retrying against the stopped etcd
    await asyncio.wait_for(member.update("transfer", "t-1", {"instances": []}), 10)
    await asyncio.wait_for(closing, 10)


async def test_a_close_says_whether_its_lease_was_revoked(registries, running_etcd: LocalEtcd) -> None:
    """An instance SIGTERMed while etcd was down logged `lease_revoked` though the revoke had failed: its
    record stays a TTL after etcd serves again (etcd restores leases), and the log said it was gone."""
    member, observer = registries
    await member.register("instance", "i-1", {"address": "127.0.0.1:1"})
    with capture_logs() as logs:
        await asyncio.wait_for(member.close(), 10)
    assert [e["event"] for e in logs if e["event"].startswith("lease_")] == ["lease_revoked"]

    await observer.register("instance", "i-2", {"address": "127.0.0.1:2"})
    running_etcd.terminate()
    with capture_logs() as logs:
        await asyncio.wait_for(observer.close(), 20)
    lease_events = [e for e in logs if e["event"].startswith("lease_")]
    assert [e["event"] for e in lease_events] == ["lease_not_revoked"]
    assert lease_events[0]["log_level"] == "warning" and lease_events[0]["expires_within_s"] == TTL_S


async def test_register_fails_fast_without_etcd(cluster: str) -> None:
    registry = Registry([f"127.0.0.1:{free_port()}"], cluster, ttl_s=TTL_S)
    with pytest.raises(Unavailable, match="--etcd-endpoints"):
        await registry.register("instances", "i-1", {})
    assert not registry.is_registered
    await registry.close()


async def test_watch_without_etcd_starts_empty_and_stale(cluster: str) -> None:
    registry = Registry([f"127.0.0.1:{free_port()}"], cluster, ttl_s=TTL_S)
    view = await registry.watch("instances", initial_sync_timeout_s=0.3)
    assert view.members == {} and view.staleness_s == float("inf") and not view.is_synced
    await registry.close()


async def test_config_json_round_trip(registries) -> None:
    member, observer = registries
    assert await member.get_json("config/policy") is None
    await member.put_json("config/policy", {"dispatch": "load", "threshold": 3.5})
    assert await observer.get_json("config/policy") == {"dispatch": "load", "threshold": 3.5}
    await member.close()  # persistent: survives the writer's lease
    assert await observer.get_json("config/policy") == {"dispatch": "load", "threshold": 3.5}


async def test_a_key_deleted_behind_a_live_members_back_is_put_again(registries, raw_etcd: Etcd3Client) -> None:
    """An operator's `etcdctl del` of a live member's key: the member renewed its lease and never looked at the
    key again, so it stayed out of every view for good while sure it was registered. It now re-checks its keys
    (one read per renewal) and puts a lost one back under its lease."""
    member, observer = registries
    await member.register("instances", "i-1", {"address": "127.0.0.1:1"})
    view = await observer.watch("instances", resync_interval_s=1.0)
    await raw_etcd.kv.delete(member.key("instances", "i-1"), timeout=5)
    await asyncio.sleep(2 * TTL_S)  # several renewals
    response = await raw_etcd.kv.get(member.key("instances", "i-1"), timeout=5)
    assert response.kvs and response.kvs[0].lease == member.lease_id, "the deleted key was never put back"
    await eventually(lambda: view.get("i-1") == {"address": "127.0.0.1:1"}, what="the key back in a view")
    assert member.is_registered and member.num_reregistrations == 1


async def test_a_key_another_lease_overwrote_leaves_the_member_unregistered_until_it_is_free(
        etcd: LocalEtcd, cluster: str, registries, raw_etcd: Etcd3Client) -> None:
    """A replacement's record put over a live member's key (under the replacement's lease) after a long pause:
    the member, still renewing its own lease, went on as registered under an id whose record names another
    process. It now sees the key carries another lease, says so (`member_id_taken`), stays unregistered while
    that lease holds the id, and registers again once it is free."""
    member, _ = registries
    await member.register("instances", "i-1", {"address": "127.0.0.1:1"})
    lease = await raw_etcd.lease.grant(ttl=60, timeout=5)  # the replacement's, renewed by nobody here
    await raw_etcd.kv.put(member.key("instances", "i-1"), json.dumps({"address": "127.0.0.1:1"}), lease=lease.ID,
                          timeout=5)
    await eventually(lambda: not member.is_registered, timeout_s=3 * TTL_S, what="the member noticing")
    response = await raw_etcd.kv.get(member.key("instances", "i-1"), timeout=5)
    assert response.kvs[0].lease == lease.ID  # not taken back while the other lease holds it
    await raw_etcd.lease.revoke(lease.ID, timeout=5)
    await eventually(lambda: member.is_registered, timeout_s=3 * TTL_S, what="registered again once free")
    response = await raw_etcd.kv.get(member.key("instances", "i-1"), timeout=5)
    assert response.kvs[0].lease == member.lease_id
