"""Write grants fence late writes: refused once revoked, and a revoke waits out the writes under way."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Aborted, FailedPrecondition, InvalidArgument
from services.transfer.domain import InstanceId
from services.transfer.write_grants import UNFENCED, WriteGrants

pytestmark = pytest.mark.timeout(10)

DST = InstanceId("dst")


async def test_unfenced_writes_go_through():
    async with WriteGrants().writing(DST, UNFENCED) as grant:
        grant.check()


async def test_a_write_under_a_grant_never_opened_is_refused_before_it_writes():
    async with WriteGrants().writing(DST, 7) as grant:
        with pytest.raises(FailedPrecondition, match="not open"):
            grant.check()


async def test_a_revoked_grant_refuses_new_writes_and_never_reopens():
    grants = WriteGrants()
    grants.grant(DST, 7)
    grants.grant(DST, 7)  # idempotent
    assert len(grants) == 1
    assert await grants.revoke(DST, 7)
    assert len(grants) == 0
    async with grants.writing(DST, 7) as grant:
        with pytest.raises(FailedPrecondition):
            grant.check()
    assert not await grants.revoke(DST, 7)  # unknown now: as safe
    async with grants.writing(InstanceId("other"), 7) as grant:  # grants are per instance
        with pytest.raises(FailedPrecondition):
            grant.check()


async def test_revoke_waits_until_the_write_under_way_stops():
    grants = WriteGrants()
    grants.grant(DST, 7)
    writer_in, writer_may_go = asyncio.Event(), asyncio.Event()
    chunks_written = []

    async def write() -> None:
        async with grants.writing(DST, 7) as grant:
            for chunk in range(3):
                grant.check()
                chunks_written.append(chunk)
                writer_in.set()
                await writer_may_go.wait()

    writer = asyncio.create_task(write())
    await writer_in.wait()
    revoke = asyncio.create_task(grants.revoke(DST, 7))
    await asyncio.sleep(0.05)
    assert not revoke.done()  # a chunk is being written
    with pytest.raises(FailedPrecondition):
        grants.grant(DST, 7)  # revoked: never opens again
    writer_may_go.set()
    with pytest.raises(Aborted, match="revoked"):
        await writer
    assert chunks_written == [0]  # the next chunk was refused
    assert await revoke


async def test_a_revoke_that_timed_out_leaves_the_grant_closed_until_its_writer_is_gone():
    grants = WriteGrants()
    grants.grant(DST, 7)
    release = asyncio.Event()

    async def write() -> None:
        async with grants.writing(DST, 7):
            await release.wait()

    writer = asyncio.create_task(write())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await grants.revoke(DST, 7)
    assert len(grants) == 0  # no longer open...
    retry = asyncio.create_task(grants.revoke(DST, 7))
    await asyncio.sleep(0.05)
    assert not retry.done()  # ...but not forgotten: a second revoke waits for the writer too
    release.set()
    await writer
    assert await retry


async def test_the_table_drops_its_oldest_idle_grant_when_full():
    grants = WriteGrants(max_grants=2)
    grants.grant(DST, 1)
    grants.grant(DST, 2)
    async with grants.writing(DST, 1):  # 1 is busy, so 2 goes
        grants.grant(DST, 3)
        async with grants.writing(DST, 3):
            with pytest.raises(FailedPrecondition, match="under way"):
                grants.grant(DST, 4)
    async with grants.writing(DST, 2) as dropped:
        with pytest.raises(FailedPrecondition):
            dropped.check()  # a dropped grant only refuses


@pytest.mark.parametrize("grant_id", [-1, 2**64])
async def test_grant_ids_out_of_range_are_refused(grant_id):
    with pytest.raises(InvalidArgument, match="write_grant"):
        WriteGrants().grant(DST, grant_id)


async def test_an_instance_that_opened_a_grant_takes_no_unfenced_write_until_it_is_unmapped():
    grants = WriteGrants()
    grants.grant(DST, 7)
    async with grants.writing(DST, UNFENCED) as grant:
        with pytest.raises(FailedPrecondition, match="fences its KV"):
            grant.check()
    async with grants.writing(InstanceId("tool-cache"), UNFENCED) as grant:
        grant.check()  # a cache no instance fences: tools and benchmarks
    grants.unfence(DST)
    async with grants.writing(DST, UNFENCED) as grant:
        grant.check()


async def test_a_new_mapping_of_the_instance_closes_every_grant_of_the_old_one():
    grants = WriteGrants()
    for grant_id in (1, 2):
        grants.grant(DST, grant_id)
    grants.grant(InstanceId("other"), 1)
    async with grants.writing(DST, 1) as busy:
        assert grants.revoke_all(DST) == 2
        with pytest.raises(Aborted):
            busy.check()  # refused from its next chunk on
        assert len(grants) == 1  # only the other instance's
    for grant_id in (1, 2):
        async with grants.writing(DST, grant_id) as grant:
            with pytest.raises(FailedPrecondition):
                grant.check()
    assert not await grants.revoke(DST, 1)  # gone once its writer left


async def test_a_grant_revoked_before_its_grant_writes_arrived_never_opens():
    """A frozen transfer service may take a RevokeWrites before the GrantWrites that was sent first."""
    grants = WriteGrants()
    assert not await grants.revoke(DST, 9)  # unknown: as safe, and remembered
    with pytest.raises(FailedPrecondition, match="never opens again"):
        grants.grant(DST, 9)
    grants.grant(InstanceId("other"), 9)  # per instance


async def test_a_grant_closed_with_its_mapping_never_opens_again():
    grants = WriteGrants()
    grants.grant(DST, 1)
    grants.revoke_all(DST)
    with pytest.raises(FailedPrecondition, match="never opens again"):
        grants.grant(DST, 1)


async def test_only_the_latest_revoked_ids_are_remembered():
    grants = WriteGrants(max_grants=2)
    for grant_id in (1, 2, 3):
        await grants.revoke(DST, grant_id)
    grants.grant(DST, 1)  # forgotten: the table stays bounded
    for grant_id in (2, 3):
        with pytest.raises(FailedPrecondition):
            grants.grant(DST, grant_id)
