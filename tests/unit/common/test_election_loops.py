"""The election's campaign and leadership loops outlive unexpected errors; the leader still steps
down when it cannot renew for a TTL, whatever the error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.election import Election
from services.common.errors import Internal
from tests.unit.loop_checks import FakeLease, assert_cancels, until

pytestmark = pytest.mark.timeout(30)  # 10 s: one test took 4.0 s of it at load 20, two workers

TTL_S = 0.3


class FakeLeases:
    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.error: BaseException | None = None

    async def grant(self, ttl, timeout=None):
        if self.errors:
            raise self.errors.pop(0)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(ID=0xE2, TTL=ttl)


class FakeKv:
    async def txn(self, compare, success, failure=None, timeout=None):
        return SimpleNamespace(succeeded=True, header=SimpleNamespace(revision=41))


def candidate(ttl_s: float = TTL_S) -> Election:
    return Election(["127.0.0.1:1"], "test", "m-1", "127.0.0.1:2", ttl_s=ttl_s)


def leading(lease: FakeLease, ttl_s: float = TTL_S) -> Election:
    election = candidate(ttl_s)
    election._lease, election.epoch = lease, 7
    return election


async def test_unexpected_renewal_errors_do_not_end_the_leadership():
    lease = FakeLease(RuntimeError("boom"))
    # A TTL of 3 s: a starved machine that wakes the loop a TTL late would (rightly) step it down; at load 14 on
    # two cores, one of 1.5 s was (the loop woke over a second late).
    election = leading(lease, ttl_s=3.0)
    loop = asyncio.create_task(election._leadership_loop())
    await until(lambda: lease.num_renewals >= 2, loop, timeout_s=20.0)
    assert election.is_leader and not election.lost.is_set()
    await assert_cancels(loop)


async def test_a_leader_that_cannot_renew_for_a_ttl_steps_down_whatever_the_error():
    lease = FakeLease()
    lease.error = Internal("boom")
    election = leading(lease)
    loop = asyncio.create_task(election._leadership_loop())
    await asyncio.wait_for(election.lost.wait(), 3 * TTL_S)
    assert not election.is_leader
    await asyncio.wait_for(loop, 1.0)  # the loop ends once leadership is lost


async def test_the_campaign_outlives_unexpected_errors_and_wins():
    election = candidate(ttl_s=30.0)  # no renewal during the test
    election._client = SimpleNamespace(lease=FakeLeases(RuntimeError("boom"), KeyError("race")), kv=FakeKv())
    await asyncio.wait_for(election.campaign(), 8.0)  # 0.3 s of backoff; 3 s ran out at load 14 on two cores
    assert election.epoch == 41
    await election._stop_leadership_loop()


async def test_cancelling_a_failing_campaign_stops_it():
    election = candidate()
    leases = FakeLeases()
    leases.error = RuntimeError("boom")
    election._client = SimpleNamespace(lease=leases, kv=FakeKv())
    campaign = asyncio.create_task(election.campaign())
    await asyncio.sleep(0.05)
    assert not campaign.done()
    await assert_cancels(campaign)
    assert not election.is_leader
