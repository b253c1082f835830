"""The destination's watchdog outlives any error from one sweep and frees what expired on the next."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Aborted, InvalidArgument, Unavailable
from services.instance.migration_in import MigrationInbox, TransferEndpoint
from services.instance.migration_slots import MigrationSlots
from tests.unit.loop_checks import assert_cancels, until
from tests.loop_errors import collect_dropped_tasks, unretrieved_errors

pytestmark = pytest.mark.timeout(10)


class FakeEngine:
    """Reserves blocks; freeing raises the scripted errors in turn."""

    def __init__(self, *free_errors: BaseException) -> None:
        self.free_errors = list(free_errors)
        self.reservations: dict[str, int] = {}
        self.freed: list[str] = []

    def reserve_blocks(self, migration_id: str, num_blocks: int, block_hashes=(), num_not_held: int = 0) -> list[int]:
        self.reservations[migration_id] = num_blocks
        return list(range(num_blocks))

    def num_cached_reserved(self, migration_id: str) -> int:
        return 0

    def block_checksums(self, block_ids) -> tuple[int, ...]:
        return tuple(0 for _ in block_ids)

    def free_reservation(self, migration_id: str) -> bool:
        if self.free_errors:
            raise self.free_errors.pop(0)
        self.freed.append(migration_id)
        return self.reservations.pop(migration_id, None) is not None


class FakeRunner:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def call(self, fn):
        return fn()

    def stream(self, request_id: str) -> None:
        return None


async def test_the_watchdog_outlives_a_failed_abort_and_frees_the_rest():
    engine, slots = FakeEngine(RuntimeError("boom")), MigrationSlots(4)
    inbox = MigrationInbox(FakeRunner(engine), slots, timeout_s=0.04, transfer=TransferEndpoint("", ""))
    await inbox.prepare("m-1", "r-1", "src", num_blocks=2)
    await inbox.prepare("m-2", "r-2", "src", num_blocks=2)
    loop = asyncio.create_task(inbox.watchdog_loop())
    await until(lambda: engine.freed == ["m-2"], loop)
    assert inbox.num_incoming == 0 and slots.num_busy == 0
    await inbox.prepare("m-3", "r-3", "src", num_blocks=1)  # and it goes on sweeping
    await until(lambda: engine.freed == ["m-2", "m-3"], loop)
    await assert_cancels(loop)


class FakeFence:
    """Write grants on a transfer service that answers revokes only while `is_answering`."""

    def __init__(self) -> None:
        self.is_answering = True
        self.granted: list[int] = []
        self.revoked: list[int] = []
        self._next_id = 0

    def new_grant_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def grant(self, grant_id: int) -> None:
        if not self.is_answering:
            raise Unavailable("transfer service down")
        self.granted.append(grant_id)

    async def revoke(self, grant_id: int) -> bool:
        if self.is_answering:
            self.revoked.append(grant_id)
        return self.is_answering


def fenced_inbox(engine: FakeEngine, slots: MigrationSlots) -> tuple[MigrationInbox, FakeFence]:
    fence = FakeFence()
    return MigrationInbox(FakeRunner(engine), slots, timeout_s=60.0, transfer=TransferEndpoint("", ""),
                          fence=fence), fence


async def test_a_reservation_is_freed_once_its_source_leaves_etcd_or_restarts():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    members = {"a": {"host": "h", "pid": 1}, "b": {"host": "h", "pid": 2}, "c": {"host": "h", "pid": 3}}
    inbox.watch_sources(members)
    for migration_id, src in (("m-a", "a"), ("m-b", "b"), ("m-c", "c"), ("m-x", "never-registered")):
        await inbox.prepare(migration_id, f"r-{src}", src, num_blocks=2)
    now = asyncio.get_running_loop().time()
    await inbox.expire(now)
    assert engine.freed == [] and slots.num_busy == 4  # every source that etcd showed is still there
    del members["a"]  # killed or frozen: its lease expired
    members["b"] = {"host": "h", "pid": 22}  # restarted under the same id: it knows nothing of m-b
    members["c"] = {"host": "h", "pid": 3, "role": "decode"}  # a new role, the same process
    await inbox.expire(now)
    assert slots.num_busy == 2 and inbox.num_incoming == 2
    assert sorted(engine.freed) == ["m-a", "m-b"]  # at once: their grants are revoked, no copy can land
    assert fence.revoked == [1, 2]
    assert inbox.num_incoming == 2  # m-c, and m-x from a source etcd never showed (left to the timeout)


async def test_blocks_stay_quarantined_until_the_transfer_service_confirms_the_revoke():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    reservation = await inbox.prepare("m-1", "r-1", "src", num_blocks=3)
    assert reservation.write_grant == 1 and fence.granted == [1]  # granted before the ids left
    fence.is_answering = False  # frozen: a copy of it may still be under way
    assert await inbox.abort("m-1")
    assert slots.num_busy == 0 and inbox.num_incoming == 0  # the slot goes at once
    assert engine.freed == [] and inbox.num_quarantined == 1  # the blocks do not
    now = asyncio.get_running_loop().time()
    await inbox.expire(now)
    assert engine.freed == [] and inbox.num_quarantined == 1
    fence.is_answering = True  # it resumed, finished its copy, and answers
    await inbox.expire(now)
    assert engine.freed == ["m-1"] and inbox.num_quarantined == 0 and fence.revoked == [1]


async def test_a_first_prepare_whose_grant_fails_holds_nothing():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    fence.is_answering = False
    with pytest.raises(Unavailable):
        await inbox.prepare("m-1", "r-1", "src", num_blocks=3)
    assert engine.reservations == {} and slots.num_busy == 0 and inbox.num_incoming == 0
    fence.is_answering = True
    await inbox.expire(asyncio.get_running_loop().time())
    assert fence.revoked == [1]  # its answer may have been lost after it opened: closed all the same
    assert inbox.num_quarantined == 0


async def abort_while_the_grant_opens(inbox: MigrationInbox, fence: FakeFence, land_grant) -> None:
    """A first Prepare aborted while its write grant is being opened; `land_grant(grant_id)` then
    opens it. The Prepare must fail, so that no source ever learns its block ids."""
    granting, may_answer = asyncio.Event(), asyncio.Event()

    async def slow_grant(grant_id: int) -> None:
        granting.set()
        await may_answer.wait()
        await land_grant(grant_id)
    fence.grant = slow_grant
    prepare = asyncio.create_task(inbox.prepare("m-1", "r-1", "src", num_blocks=3))
    await granting.wait()
    assert await inbox.abort("m-1")
    may_answer.set()
    with pytest.raises(Aborted, match="aborted while"):
        await prepare


async def test_a_reservation_given_up_while_its_grant_is_being_opened_never_leaves():
    """An abort (or the watchdog) between the reserve and the grant frees the blocks unfenced."""
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    await abort_while_the_grant_opens(inbox, fence, fence.grant)
    assert engine.reservations == {} and slots.num_busy == 0 and inbox.num_incoming == 0
    assert fence.revoked == [1, 1]  # by the abort (before the grant landed), and again after it


async def test_a_grant_that_opened_after_its_reservation_was_given_up_is_revoked_once_the_service_answers():
    """The grant lands after an abort, and the transfer service then stops answering: the open grant is
    asked to close on every sweep until it is."""
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)

    async def grant_then_go_quiet(grant_id: int) -> None:
        fence.granted.append(grant_id)  # it opened ...
        fence.is_answering = False  # ... and then the service froze
    await abort_while_the_grant_opens(inbox, fence, grant_then_go_quiet)
    assert engine.reservations == {} and slots.num_busy == 0 and inbox.num_incoming == 0
    assert fence.granted == [1] and fence.revoked == [1]  # only the abort's revoke, before the grant landed
    now = asyncio.get_running_loop().time()
    await inbox.expire(now)
    assert fence.revoked == [1]  # still open: asked again on the next sweep
    fence.is_answering = True
    await inbox.expire(now)
    assert fence.revoked == [1, 1] and inbox.num_quarantined == 0
    await inbox.expire(now)
    assert fence.revoked == [1, 1]  # confirmed once: not asked again


async def test_while_blocks_wait_for_an_unanswered_revoke_others_queue_behind_them_without_asking():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    for migration_id in ("m-1", "m-2", "m-3"):
        await inbox.prepare(migration_id, "r", "src", num_blocks=1)
    fence.is_answering = False
    asked = []
    plain_revoke = fence.revoke

    async def counted_revoke(grant_id: int) -> bool:
        asked.append(grant_id)
        return await plain_revoke(grant_id)
    fence.revoke = counted_revoke
    for migration_id in ("m-1", "m-2", "m-3"):
        assert await inbox.abort(migration_id)
    assert asked == [1] and inbox.num_quarantined == 3  # a frozen service costs one call, not three
    await inbox.expire(asyncio.get_running_loop().time())
    assert asked == [1, 1]  # the sweep stops at the first unanswered one
    fence.is_answering = True
    await inbox.expire(asyncio.get_running_loop().time())
    assert sorted(engine.freed) == ["m-1", "m-2", "m-3"] and inbox.num_quarantined == 0


async def test_a_commit_taken_up_after_its_callers_deadline_is_refused_and_frees_the_reservation():
    """A destination frozen while the source's CommitMigrateIn waited: the source gave up (its call
    timed out, its abort found nobody answering) and resumed the request. Before, the thawed
    destination adopted it anyway, a copy decoding for no client (a black-box PD fault run)."""
    import time

    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    await inbox.prepare("m-1", "r-1", "src", num_blocks=2)
    with pytest.raises(Aborted, match="after its caller's deadline"):
        await inbox.commit("m-1", object(), deadline=time.monotonic() - 0.1)  # the state is never read
    assert engine.freed == ["m-1"] and inbox.num_incoming == 0 and slots.num_busy == 0


async def test_a_prepare_cancelled_while_its_grant_is_unanswered_leaves_no_unread_error():
    """A PD hand-off's first Prepare has a 1 s deadline (--pd-handoff-hold-s), the grant RPC 2 s: with the
    destination's transfer service frozen, the Prepare was cancelled while it waited for the grant, whose
    failure nobody read: "Task exception was never retrieved" and a traceback as an [error] line in the
    decode instance's log, once per hand-off tried (found by a PD chaos run freezing the transfer service)."""
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    granting, may_answer = asyncio.Event(), asyncio.Event()

    async def unanswered_grant(grant_id: int) -> None:
        granting.set()
        await may_answer.wait()
        raise Unavailable("the transfer service did not answer: deadline exceeded")
    fence.grant = unanswered_grant
    with unretrieved_errors() as unretrieved:
        prepare = asyncio.create_task(inbox.prepare("m-1", "r-1", "src", num_blocks=3))
        await granting.wait()
        await asyncio.sleep(0)  # the reserve is done: it waits for the grant
        prepare.cancel()  # the source's deadline
        with pytest.raises(asyncio.CancelledError):
            await prepare
        may_answer.set()  # the grant fails after all
        await collect_dropped_tasks()
        assert not unretrieved, unretrieved
    assert engine.reservations == {} and slots.num_busy == 0 and inbox.num_incoming == 0


async def test_a_prepare_overtaken_by_its_own_abort_is_refused_and_reserves_nothing():
    """The source gave up (its Prepare's deadline passed) and sent AbortMigrateIn, which landed before that
    Prepare did: the abort found nothing, and the Prepare then held its blocks (and a migration slot) until
    the watchdog freed them, --migration-reservation-timeout-s later."""
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox, fence = fenced_inbox(engine, slots)
    assert not await inbox.abort("m-1")
    with pytest.raises(Aborted, match="m-1.*aborted"):
        await inbox.prepare("m-1", "r-1", "src", num_blocks=3)
    assert engine.reservations == {} and slots.num_busy == 0 and inbox.num_incoming == 0 and fence.granted == []
    await inbox.prepare("m-2", "r-1", "src", num_blocks=3)  # another attempt at the request is welcome


async def test_aborted_migrations_are_remembered_for_the_reservation_timeout():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox = MigrationInbox(FakeRunner(engine), slots, timeout_s=0.1, transfer=TransferEndpoint("", ""))
    assert not await inbox.abort("m-1")
    await asyncio.sleep(0.15)
    await inbox.prepare("m-1", "r-1", "src", num_blocks=1)  # a Prepare that late: the watchdog's again
    assert inbox.num_incoming == 1


async def test_a_bad_prepare_names_the_field_that_is_wrong_only():
    """An empty migration_id was refused with 'migration_id: required; num_blocks: must be >= 0', naming a
    num_blocks of 0 that is fine (h_ops7: PrepareMigrateIn {} through reflection)."""
    inbox = MigrationInbox(FakeRunner(FakeEngine()), MigrationSlots(4), timeout_s=1.0, transfer=TransferEndpoint("", ""))
    with pytest.raises(InvalidArgument) as missing_id:
        await inbox.prepare("", "r-1", "src", num_blocks=0)
    assert missing_id.value.message == "migration_id: required"
    with pytest.raises(InvalidArgument) as negative:
        await inbox.prepare("m-1", "r-1", "src", num_blocks=-2)
    assert negative.value.message == "num_blocks: must be >= 0, got -2"
