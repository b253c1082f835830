"""The manager's campaign and leader watch outlive any error from one term or one look at the key."""

from __future__ import annotations

import asyncio

import pytest

from services.common.election import LeaderInfo
from services.common.errors import Internal
from services.manager.cluster_view import ClusterView
from services.manager.election_loop import Campaign
from services.manager.leadership import Leader, Leadership
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FakeElection:
    """Each campaign raises the next scripted error, or wins at once."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.lost = asyncio.Event()
        self.epoch: int | None = None
        self.num_campaigns = 0
        self.num_resigns = 0

    async def campaign(self) -> None:
        self.num_campaigns += 1
        if self.errors:
            raise self.errors.pop(0)
        self.lost.clear()
        self.epoch = self.num_campaigns

    async def resign(self) -> None:
        self.num_resigns += 1
        self.epoch = None

    async def close(self) -> None:
        await self.resign()


class FlakyClusterView(ClusterView):
    """A view whose first take-over raises."""

    def __init__(self) -> None:
        super().__init__(report_timeout_s=3.0)
        self.num_terms = 0

    def start_leading(self, is_membership_read: bool = True) -> None:
        self.num_terms += 1
        if self.num_terms == 1:
            raise RuntimeError("boom")
        super().start_leading(is_membership_read)


class FakeLeaderView:
    """The leader key: the scripted values in turn (an exception is raised); `changed()` waits for `bump()`."""

    def __init__(self, *leaders: LeaderInfo | BaseException) -> None:
        self.leaders = list(leaders)
        self._changed = asyncio.Event()

    @property
    def leader(self) -> LeaderInfo | None:
        leader = self.leaders.pop(0) if len(self.leaders) > 1 else self.leaders[0]
        if isinstance(leader, BaseException):
            raise leader
        return leader

    def bump(self) -> None:
        self._changed.set()

    async def changed(self) -> LeaderInfo | None:
        await self._changed.wait()
        self._changed.clear()
        return None


def campaign(election: FakeElection, view: ClusterView | None = None,
             leader_view: FakeLeaderView | None = None) -> tuple[Campaign, Leadership]:
    leadership = Leadership("m-1", "127.0.0.1:1")
    return Campaign(election, leader_view or FakeLeaderView(None), leadership,
                    view or ClusterView(report_timeout_s=3.0)), leadership


async def test_a_failed_campaign_is_retried_and_leads():
    election = FakeElection(Internal("boom"))
    manager, leadership = campaign(election)
    loop = asyncio.create_task(manager.campaign_loop())
    await until(lambda: leadership.is_leader, loop)
    assert election.num_campaigns == 2
    election.lost.set()  # the term ends as before: step down, campaign again, lead
    await until(lambda: election.num_campaigns == 3 and leadership.is_leader, loop)
    await assert_cancels(loop)


async def test_a_failed_take_over_steps_down_resigns_and_leads_next_term():
    election = FakeElection()
    view = FlakyClusterView()
    manager, leadership = campaign(election, view=view)
    loop = asyncio.create_task(manager.campaign_loop())
    await until(lambda: leadership.is_leader, loop)
    assert (election.num_campaigns, election.num_resigns, view.num_terms) == (2, 1, 2)
    await assert_cancels(loop)


async def test_the_leader_watch_outlives_a_malformed_key():
    leader_view = FakeLeaderView(KeyError("leader_id"), LeaderInfo("m-2", "127.0.0.1:2"))
    manager, leadership = campaign(FakeElection(), leader_view=leader_view)
    loop = asyncio.create_task(manager.leader_watch_loop())
    await until(lambda: leadership.leader == Leader("m-2", "127.0.0.1:2"), loop)
    leader_view.leaders = [LeaderInfo("m-3", "127.0.0.1:3")]
    leader_view.bump()
    await until(lambda: leadership.leader == Leader("m-3", "127.0.0.1:3"), loop)
    await assert_cancels(loop)
