"""The PD hand-off workers outlive any error from one hand-off; the request it hit decodes here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from services.common.errors import Aborted, FailedPrecondition, Internal, ResourceExhausted, Unavailable
from services.instance.config import InstanceRole, PdHandoff
from services.instance.migration_domain import MigrateOutPlan, MigrationResult, RefusedByDestination
from services.instance.pd_handoff import DecodeHandoff, DecodePlace
from services.transfer.domain import TransferBackend
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FakeEngine:
    def __init__(self, *resume_errors: BaseException) -> None:
        self.resume_errors = list(resume_errors)
        self.held: list[str] = []
        self.resumed: list[str] = []
        self.num_blocks: dict[str, int] = {}  # KV blocks each request holds (1 if not set)
        self.reaches: dict[str, int] = {}  # each request's prompt + max_tokens (0 if not set)

    def migration_blocks(self, request_id: str) -> SimpleNamespace:
        return SimpleNamespace(num_blocks=self.num_blocks.get(request_id, 1),
                               max_num_tokens=self.reaches.get(request_id, 0))

    def hold(self, request_id: str) -> None:
        self.held.append(request_id)

    def resume(self, request_id: str) -> None:
        if self.resume_errors:
            raise self.resume_errors.pop(0)
        self.resumed.append(request_id)


class FakeRunner:
    """Runs engine calls at once; every request is running but those in `gone`."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.gone: set[str] = set()
        self._streams: dict[str, SimpleNamespace] = {}

    def call_soon(self, fn) -> None:
        fn()

    async def call(self, fn):
        return fn()

    def stream(self, request_id: str) -> SimpleNamespace | None:
        return None if request_id in self.gone else self._streams.setdefault(request_id, SimpleNamespace(
            request_id=request_id))

    def owns(self, stream) -> bool:
        return stream is not None and self.stream(stream.request_id) is stream

    def replace(self, request_id: str) -> SimpleNamespace:
        """The copy running under `request_id` was aborted and a resume of the request here took the id."""
        stream = self._streams[request_id] = SimpleNamespace(request_id=request_id)
        return stream

    async def resume(self, stream) -> bool:
        return self.owns(stream) and self.engine.resume(stream.request_id) is None

    def resume_soon(self, stream) -> None:
        if self.owns(stream):
            self.engine.resume(stream.request_id)


class FakeMigrations:
    """MigrateOut raises the scripted errors in turn, then moves the request."""

    moving = frozenset()
    has_free_slot = True  # our --max-concurrent-migrations slots
    can_migrate = True  # False: no --transfer-address

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.plans: list[MigrateOutPlan] = []
        self.copies: list = []  # the copy each MigrateOut was asked to move
        self.claimed: dict = {}  # request id in `moving` → the copy its migration moves (default: the one asked)

    def moves(self, copy) -> bool:
        return copy is not None and copy.request_id in self.moving and self.claimed.get(copy.request_id, copy) is copy

    async def migrate_out(self, plan: MigrateOutPlan, copy=None) -> MigrationResult:
        self.plans.append(plan)
        self.copies.append(copy)
        if self.errors:
            raise self.errors.pop(0)
        return MigrationResult(plan.request_id, "p-1", plan.dst_instance_id, num_blocks=1, num_bytes=64, num_stages=1,
                               backend=TransferBackend.GRPC, duration_ms=1.0, downtime_ms=1.0)


class FlakyPlacer:
    """PlaceDecode raises the scripted errors in turn, then names d-1 (with `decode_ids`: the first not refused)."""

    def __init__(self, *errors: BaseException, decode_ids: tuple[str, ...] = ()) -> None:
        self.errors = list(errors)
        self.decode_ids = decode_ids
        self.asks: list[tuple[str, int, tuple[str, ...]]] = []  # (request id, num_blocks, refused) of each call
        self.reported: list[str] = []
        self.failed: list[tuple[str, str, str]] = []
        self.reaches: list[int] = []  # each call's max_num_tokens

    async def place_decode(self, request_id: str, src_instance_id: str, num_blocks: int,
                           refused=(), max_num_tokens: int = 0) -> DecodePlace:
        self.asks.append((request_id, num_blocks, tuple(refused)))
        self.reaches.append(max_num_tokens)
        if self.errors:
            raise self.errors.pop(0)
        if not self.decode_ids:
            return DecodePlace("d-1", "127.0.0.1:1")
        left = [i for i in self.decode_ids if i not in refused]
        if not left:
            raise ResourceExhausted(f"every decode instance refused request {request_id}")
        return DecodePlace(left[0], f"addr-{left[0]}")

    async def report_migration(self, result: MigrationResult, started_at: float) -> None:
        self.reported.append(result.request_id)

    async def report_failed_migration(self, plan, src_instance_id: str, error, started_at: float) -> None:
        self.failed.append((plan.request_id, src_instance_id, error.grpc_code.name))
        self.failed_at = plan.dst_instance_id


class StuckMigrations(FakeMigrations):
    """The first MigrateOut hangs until `unstick` (a destination that answers nothing), the rest move."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = asyncio.Event()

    async def migrate_out(self, plan: MigrateOutPlan, copy=None) -> MigrationResult:
        if not self.plans:
            self.plans.append(plan)
            await self.stuck.wait()
            raise Unavailable("the destination did not answer before the deadline")
        return await super().migrate_out(plan)


def parked(num_blocks: int = 2, max_num_tokens: int = 0) -> SimpleNamespace:
    """Stands for the HeldRequest the runner parked with the first token (its blocks and its state's reach
    are read)."""
    return SimpleNamespace(blocks=SimpleNamespace(num_blocks=num_blocks),
                           state=SimpleNamespace(max_num_tokens=max_num_tokens))


# The hold time of a test that does not pass its own: never reached before the test's timeout. With 1 s, a loaded
# machine that paused this process for a second between a note_prefilled and the worker's start had the hold timer
# resume requests the test expected parked (['r-1', 'r-2', 'r-1'] resumed where ['r-1'] was).
_HOLD_S = 60.0


def pushing(engine: FakeEngine, placer: FlakyPlacer, migrations: FakeMigrations,
            hold_s: float = _HOLD_S) -> DecodeHandoff:
    return DecodeHandoff("p-1", FakeRunner(engine), migrations, placer, PdHandoff.PUSH, lambda: InstanceRole.PREFILL,
                         hold_s=hold_s)


async def test_a_hand_off_gives_its_destination_hold_s_to_prepare():
    """A frozen decode instance held the parked request for --migration-rpc-timeout-s (5 s) before."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()
    handoff = pushing(engine, placer, migrations, hold_s=0.75)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert migrations.plans[0].prepare_timeout_s == 0.75
    await assert_cancels(loop)


async def test_an_unexpected_error_resumes_the_request_here_and_the_next_one_moves():
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations(RuntimeError("boom"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    handoff.note_prefilled("r-2")
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert engine.held == ["r-1", "r-2"]
    assert engine.resumed == ["r-1"]  # it decodes here; the manager's loop may move it later
    assert [plan.request_id for plan in migrations.plans] == ["r-1", "r-2"]
    await until(lambda: placer.reported == ["r-2"], loop)
    assert handoff.num_prefilled({"r-1"}) == 1  # r-1 is no longer pending
    await assert_cancels(loop)
    await handoff.close()


async def test_a_failed_resume_does_not_stop_the_workers():
    engine, placer, migrations = FakeEngine(KeyError("r-1")), FlakyPlacer(Internal("boom")), FakeMigrations()
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    handoff.note_prefilled("r-2")
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert engine.resumed == []
    assert [plan.request_id for plan in migrations.plans] == ["r-2"]
    await assert_cancels(loop)
    await handoff.close()


async def test_a_retried_hand_off_does_not_reuse_the_parked_state():
    """A failed attempt may resume the request (it decodes here meanwhile): the retry must
    suspend it afresh, never copy the state parked at its first token."""
    held = parked(3, max_num_tokens=350)  # stands for the HeldRequest the runner parked with the first token
    engine, placer = FakeEngine(), FlakyPlacer()
    migrations = FakeMigrations(ResourceExhausted("the destination runs a migration already"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", held)
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert [plan.held for plan in migrations.plans] == [held, None]
    assert placer.reaches[0] == 350  # the manager passes over decode instances serving shorter sequences
    assert engine.held == []  # parked by the runner already
    await assert_cancels(loop)
    await handoff.close()


async def test_a_hand_off_that_fails_is_reported_to_the_history_and_decodes_here():
    engine, placer = FakeEngine(), FlakyPlacer()
    busy = ResourceExhausted("the destination runs a migration already")
    migrations = FakeMigrations(busy, busy, busy, busy, Internal("the copy's checksum differs"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")  # four busy answers in a row: given up
    await until(lambda: placer.failed == [("r-1", "p-1", "RESOURCE_EXHAUSTED")], loop)
    handoff.note_prefilled("r-2")  # not worth a retry
    await until(lambda: len(placer.failed) == 2, loop)
    assert placer.failed[1] == ("r-2", "p-1", "INTERNAL")
    assert engine.resumed == ["r-1", "r-2"] and placer.reported == [] and handoff.num_handed_off == 0
    await assert_cancels(loop)
    await handoff.close()


async def test_a_hand_off_to_a_decode_instance_that_is_gone_tries_the_next_one():
    """A decode instance killed under a burst stays named by PlaceDecode until its lease expires; before, each
    hand-off that failed UNAVAILABLE there left its request decoding on the prefill instance."""
    engine, placer = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2"))
    migrations = FakeMigrations(Unavailable("failed to connect to all addresses"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert [plan.dst_instance_id for plan in migrations.plans] == ["d-1", "d-2"]
    assert placer.asks[1][2] == ("d-1",)  # the second place excludes the one that was gone
    assert placer.failed == [] and placer.reported == ["r-1"]
    await assert_cancels(loop)
    await handoff.close()


async def test_a_place_decode_cut_under_the_worker_resumes_the_request_and_the_worker_goes_on():
    """A call cancelled from outside (before: a leader change closed the shared channel under it) ended
    the worker for good and left its request parked with nobody to resume it."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(asyncio.CancelledError()), FakeMigrations()
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    handoff.note_prefilled("r-2")
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert engine.resumed == ["r-1"] and [plan.request_id for plan in migrations.plans] == ["r-2"]
    await assert_cancels(loop)
    await handoff.close()


async def test_requests_queued_behind_a_stuck_hand_off_decode_here_until_a_worker_takes_them():
    """Before, a hand-off to a frozen decode instance kept every queued request parked (no token)
    until its call's deadline, 5 s by default."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(decode_ids=("d-1",)), StuckMigrations()  # no other
    handoff = pushing(engine, placer, migrations, hold_s=0.05)
    loop = asyncio.create_task(handoff.handoff_loop())
    held = parked(2)
    for request_id, state in (("r-1", None), ("r-2", held), ("r-3", None)):
        handoff.note_prefilled(request_id, state)
    await until(lambda: engine.resumed == ["r-2", "r-3"], loop)  # r-1's hand-off is stuck; they decode here
    assert handoff.num_prefilled({"r-2", "r-3"}) == 0  # queued: their hand-offs will move them
    assert handoff.num_prefilled({"x"}) == 1  # one whose hand-off failed earlier: the manager's (r-2, r-3 finished)
    migrations.stuck.set()
    await until(lambda: handoff.num_handed_off == 2, loop)
    assert [plan.held for plan in migrations.plans] == [None, None, None]  # r-2's parked state is stale: suspended afresh
    assert engine.resumed == ["r-2", "r-3", "r-1"]  # r-1 decodes here after its failed hand-off
    assert handoff.num_prefilled({"r-1"}) == 1
    await assert_cancels(loop)
    await handoff.close()


async def test_a_request_taken_within_the_hold_time_stays_parked():
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()
    handoff = pushing(engine, placer, migrations, hold_s=0.05)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    await until(lambda: handoff.num_handed_off == 1, loop)
    await asyncio.sleep(0.1)
    assert engine.resumed == []  # its timer was called off
    await assert_cancels(loop)
    await handoff.close()


class SlowMigrations(FakeMigrations):
    """Every MigrateOut takes `seconds`: a queue that moves, one request at a time."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def migrate_out(self, plan: MigrateOutPlan, copy=None) -> MigrationResult:
        await asyncio.sleep(self.seconds)
        return await super().migrate_out(plan)


async def test_requests_parked_hold_s_in_a_queue_that_moves_decode_here_until_taken():
    """A burst: hand-offs go one at a time, so the queue moves but the last request waits for all. Before, a
    queue that moved kept its requests parked however long (a black-box run: second tokens up to 18 s late)."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), SlowMigrations(0.05)
    handoff = pushing(engine, placer, migrations, hold_s=0.3)
    loop = asyncio.create_task(handoff.handoff_loop())
    request_ids = [f"r-{n}" for n in range(20)]  # ~1 s of hand-offs, one every 0.05 s
    for request_id in request_ids:
        handoff.note_prefilled(request_id)
    await until(lambda: "r-19" in engine.resumed, loop)  # parked 0.3 s: it decodes here meanwhile
    assert "r-0" not in engine.resumed  # taken at once
    await until(lambda: handoff.num_handed_off == 20, loop)  # every one still moves, suspended afresh
    assert [plan.request_id for plan in migrations.plans] == request_ids
    assert all(plan.held is None for plan in migrations.plans)
    await assert_cancels(loop)
    await handoff.close()


async def test_requests_parked_for_their_hand_off_are_not_taken_off_the_decoding_ones():
    """`num_decoding` counts running requests; parked ones are not among them. Before, each queued hand-off
    was subtracted again, so requests decoding here unhandled were reported as none."""
    migrations = FakeMigrations()
    handoff = pushing(FakeEngine(), FlakyPlacer(), migrations)
    handoff.note_prefilled("p-0")
    handoff.note_prefilled("p-1")  # parked, queued: no worker runs in this test
    assert handoff.num_prefilled({"d-0", "d-1"}) == 2  # two others decode here
    migrations.moving = frozenset({"d-0"})  # a rebalancing migration moves one of them
    assert handoff.num_prefilled({"d-0", "d-1"}) == 1


async def test_a_hand_off_whose_request_finished_meanwhile_is_no_failure():
    """A request decoding here in a stall may finish while its hand-off runs: the source answers NOT_FOUND.
    That was reported as a failed pd migration (history, failure metrics) though nothing failed."""
    from services.common.errors import NotFound

    class FinishesFirst(FakeMigrations):
        async def migrate_out(self, plan, copy=None):
            handoff._runner.gone.add(plan.request_id)
            return await super().migrate_out(plan)

    engine, placer = FakeEngine(), FlakyPlacer()
    handoff = pushing(engine, placer, FinishesFirst(NotFound("request r-1 is not on this instance")))
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    handoff.note_prefilled("r-2")
    await until(lambda: placer.reported == ["r-2"], loop)  # the next one moved
    assert placer.failed == []
    await assert_cancels(loop)
    await handoff.close()


async def test_a_hand_off_whose_request_another_migration_moves_is_no_failure():
    """A request decoding here in a stall may be taken by another migration (a drain, the manager's PD loop)
    before a worker takes its hand-off: the claim is refused. That was reported as a failed pd migration
    (history, failure metrics) though the request was on its way to a decode instance all the same."""
    from services.common.errors import FailedPrecondition

    class MovedByAnother(FakeMigrations):
        async def migrate_out(self, plan, copy=None):
            self.moving = frozenset({plan.request_id})  # the drain's claim
            return await super().migrate_out(plan)

    engine, placer = FakeEngine(), FlakyPlacer()
    handoff = pushing(engine, placer, MovedByAnother(FailedPrecondition("request r-1 is already migrating")))
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")
    await until(lambda: "r-1" not in handoff._pending, loop)
    await asyncio.sleep(0.05)
    assert placer.failed == []
    assert engine.resumed == []  # the other migration owns it
    await assert_cancels(loop)
    await handoff.close()


async def test_a_queued_request_another_migration_holds_past_its_hold_time_does_not_spin_the_loop():
    """A queued request another migration claimed (an operator's Migrate of it, or a rebalance that had it when
    SetRole made this instance PREFILL) is not resumed at its hold time: that migration owns it. Before, the wait
    check then rescheduled itself at once, again and again, a busy event loop until a worker or that migration
    took the request (seconds behind a stuck hand-off)."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), StuckMigrations()
    handoff = pushing(engine, placer, migrations, hold_s=0.05)
    num_checks = 0
    check_waits = handoff._check_waits

    def counted_check_waits() -> None:
        nonlocal num_checks
        num_checks += 1
        check_waits()
    handoff._check_waits = counted_check_waits
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")  # its hand-off gets stuck: the only worker is busy
    await until(lambda: migrations.plans, loop)
    migrations.moving = frozenset({"r-2"})  # claimed by another migration while queued here
    handoff.note_prefilled("r-2", parked(2))
    handoff.note_prefilled("r-3", parked(2))
    await until(lambda: engine.resumed == ["r-3"], loop)  # r-3 decodes here; r-2 is the other migration's
    await asyncio.sleep(0.3)
    assert num_checks < 20, f"{num_checks} wait checks in 0.3 s"
    migrations.moving = frozenset()  # that migration ended without a commit (its abandon resumed r-2)
    await until(lambda: engine.resumed == ["r-3", "r-2"], loop)  # checked again: no longer parked here either
    migrations.stuck.set()
    await assert_cancels(loop)
    await handoff.close()


async def test_a_decode_instance_without_room_is_skipped_for_the_next_freest():
    """Before, a hand-off tried the decode instance that had refused it (RESOURCE_EXHAUSTED: no free blocks or
    batch slot) four times in a row, and then decoded here, while another decode instance had room."""
    engine, placer = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2", "d-3"))
    migrations = FakeMigrations(ResourceExhausted("instance d-1 has 2 free KV blocks, the request needs 5"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(5))
    await until(lambda: placer.reported == ["r-1"], loop)
    assert [plan.dst_instance_id for plan in migrations.plans] == ["d-1", "d-2"]
    assert placer.asks == [("r-1", 5, ()), ("r-1", 5, ("d-1",))]
    assert [plan.held is None for plan in migrations.plans] == [False, True]  # the failed try may have resumed it
    await assert_cancels(loop)
    await handoff.close()


async def test_a_decode_instance_that_refuses_by_role_is_skipped_for_the_next_freest():
    """A SetRole to PREFILL while etcd is away changes the role there before the managers see it, so PlaceDecode
    may still name that instance, which refuses (FAILED_PRECONDITION). Before, the request then decoded here, on
    the prefill instance, until the manager's migration loop moved it."""
    engine, placer = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2"))
    migrations = FakeMigrations(RefusedByDestination("instance d-1 has role prefill and takes no migrations in"))
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(4, max_num_tokens=300))
    await until(lambda: placer.reported == ["r-1"], loop)
    assert [plan.dst_instance_id for plan in migrations.plans] == ["d-1", "d-2"]
    assert placer.asks == [("r-1", 4, ()), ("r-1", 4, ("d-1",))] and placer.reaches == [300, 300]
    assert engine.resumed == [] and placer.failed == []
    await assert_cancels(loop)
    await handoff.close()


async def test_a_refusal_of_the_prefill_instances_own_ends_the_hand_off_at_once():
    """A prefill instance started without --transfer-address refuses every MigrateOut itself (FAILED_PRECONDITION):
    the hand-off took that for the decode instance's refusal by role and asked for the next one, four tries in all,
    each parking the request again. It ends at the first now, and the request decodes here."""
    engine, placer = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2", "d-3"))
    migrations = FakeMigrations(*[FailedPrecondition("live migration needs a transfer service: start this instance "
                                                     "with --transfer-address")] * 4)
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await until(lambda: placer.failed == [("r-1", "p-1", "FAILED_PRECONDITION")], loop)
    assert [plan.dst_instance_id for plan in migrations.plans] == ["d-1"]
    assert placer.asks == [("r-1", 2, ())]
    assert engine.resumed == ["r-1"]  # it decodes here
    await assert_cancels(loop)
    await handoff.close()


async def test_a_hand_off_every_decode_instance_refused_is_reported_at_the_last_one_and_decodes_here():
    engine, placer = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2"))
    full = ResourceExhausted("no batch slot")
    migrations = FakeMigrations(full, full)
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await until(lambda: placer.failed == [("r-1", "p-1", "RESOURCE_EXHAUSTED")], loop)
    assert placer.failed_at == "d-2" and [plan.dst_instance_id for plan in migrations.plans] == ["d-1", "d-2"]
    assert engine.resumed == ["r-1"] and not handoff.is_decode_missing  # full, not missing
    await assert_cancels(loop)
    await handoff.close()


async def test_our_own_busy_migration_slots_wait_for_the_same_destination():
    """Our slots (--max-concurrent-migrations) are no reason to pass the destination over."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(decode_ids=("d-1", "d-2")), FakeMigrations()
    migrations.has_free_slot = False
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await asyncio.sleep(0.02)
    migrations.has_free_slot = True  # a migration in ended
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert [plan.dst_instance_id for plan in migrations.plans] == ["d-1"] and len(placer.asks) == 1
    await assert_cancels(loop)
    await handoff.close()


async def test_place_decode_is_told_how_many_blocks_the_request_holds():
    """Before, every PlaceDecode said 0 blocks: the manager could neither pick a decode instance with room for them
    nor count them against the one it picked (the next placement of a burst saw it as free as before)."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()
    engine.num_blocks["r-2"] = 7  # decoding here (SetRole to PREFILL): the engine says
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(3))  # parked at its first token: its state says
    handoff.note_prefilled("r-2")
    await until(lambda: handoff.num_handed_off == 2, loop)
    assert placer.asks == [("r-1", 3, ()), ("r-2", 7, ())]
    await assert_cancels(loop)
    await handoff.close()


async def test_a_hand_off_without_parked_state_tells_place_decode_the_requests_reach():
    """Before, a request decoding here when its hand-off began (parked past --pd-handoff-hold-s, or a SetRole to
    PREFILL) was placed with reach 0, by load alone: it could land on a decode instance serving shorter sequences,
    which refused it or ended it early."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()
    engine.reaches["r-2"] = 900  # decoding here: the engine says
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(3, max_num_tokens=500))  # parked at its first token: its state says
    handoff.note_prefilled("r-2")
    await until(lambda: handoff.num_handed_off == 2, loop)
    assert placer.reaches == [500, 900]
    await assert_cancels(loop)
    await handoff.close()


async def test_a_request_that_finished_before_its_blocks_were_counted_ends_its_hand_off_quietly():
    from services.common.errors import NotFound

    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()

    def finished(request_id: str):
        raise NotFound(f"request {request_id} is not on this instance")
    engine.migration_blocks = finished
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1")  # decoding here (not parked): its blocks are asked of the engine
    await until(lambda: "r-1" not in handoff._pending, loop)
    assert placer.asks == [] and placer.failed == [] and migrations.plans == []
    await assert_cancels(loop)
    await handoff.close()


class CopyMigrations(FakeMigrations):
    """MigrateOut of a copy that no longer owns its id fails as the driver's does (Aborted); one of an id
    another migration claims is refused (FailedPrecondition). With `stuck`, the first waits for it."""

    def __init__(self, runner: FakeRunner, stuck: asyncio.Event | None = None) -> None:
        super().__init__()
        self.runner, self.stuck = runner, stuck

    async def migrate_out(self, plan: MigrateOutPlan, copy=None) -> MigrationResult:
        if plan.request_id in self.moving:
            raise FailedPrecondition(f"request {plan.request_id} is already migrating; wait for it to end")
        if self.stuck is not None and not self.plans:
            self.plans.append(plan)
            self.copies.append(copy)
            await self.stuck.wait()
        elif self.runner.owns(copy):
            return await super().migrate_out(plan, copy)
        raise Aborted(f"request {plan.request_id} finished or was aborted while migrating")


def pushing_copies(stuck: asyncio.Event | None = None, hold_s: float = _HOLD_S
                   ) -> tuple[FakeEngine, FakeRunner, CopyMigrations, DecodeHandoff]:
    engine = FakeEngine()
    runner = FakeRunner(engine)
    migrations = CopyMigrations(runner, stuck)
    handoff = DecodeHandoff("p-1", runner, migrations, FlakyPlacer(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL,
                            hold_s=hold_s)
    return engine, runner, migrations, handoff


async def test_a_copy_that_replaced_its_request_while_the_old_ones_hand_off_moved_gets_its_own():
    """The frontend resumed r-1 here (its stream broke) while the first copy's hand-off was in its MigrateOut: the new
    copy's first token came with that hand-off pending. Before, the new copy was resumed at once and decoded here,
    on the prefill instance, until the manager's migration loop moved it (if at all)."""
    engine, runner, migrations, handoff = pushing_copies(stuck=asyncio.Event())
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await until(lambda: migrations.plans, loop)  # the first copy's MigrateOut hangs
    old, new = runner.stream("r-1"), runner.replace("r-1")
    held = parked(3)
    handoff.note_prefilled("r-1", held)  # the new copy's first token, parked in its step
    await asyncio.sleep(0.05)
    assert engine.resumed == [] and engine.held == []  # parked for its own hand-off
    migrations.stuck.set()  # the old copy's MigrateOut fails: its copy is gone
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert migrations.copies == [old, new] and migrations.plans[1].held is held
    assert engine.resumed == [] and "r-1" not in handoff._pending
    await assert_cancels(loop)
    await handoff.close()


async def test_a_copy_that_replaced_its_request_while_the_old_one_was_queued_takes_its_queue_entry():
    """As above, the old copy's hand-off still queued (the only worker busy): the worker moves the new copy, with its
    own parked state, once. Before, the new copy decoded here and the worker found the old one gone."""
    engine, runner, migrations, handoff = pushing_copies(stuck=asyncio.Event())
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-0", parked(2))
    await until(lambda: migrations.plans, loop)  # the only worker is stuck on r-0
    handoff.note_prefilled("r-1", parked(2))
    new = runner.replace("r-1")
    held = parked(4)
    handoff.note_prefilled("r-1", held)
    await asyncio.sleep(0.05)
    assert engine.resumed == []
    runner.replace("r-0")  # (r-0's MigrateOut then fails, and its new copy is not the hand-off's)
    migrations.stuck.set()
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert migrations.copies[1:] == [new] and migrations.plans[1].held is held
    assert engine.resumed == [] and handoff._pending == {} and handoff._queue.empty()
    await assert_cancels(loop)
    await handoff.close()


async def test_a_copy_waits_for_the_migration_its_older_copy_claimed_before_its_hand_off():
    """The manager's loop claimed r-1 for the old copy, which the frontend then replaced here. That migration ends at
    its next call; the new copy's hand-off waits for it. Before, its MigrateOut was refused (already migrating),
    taken for another migration moving this copy, and the new copy stayed parked for good."""
    engine, runner, migrations, handoff = pushing_copies()
    migrations.moving, migrations.claimed["r-1"] = frozenset({"r-1"}), runner.stream("r-1")
    new = runner.replace("r-1")
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await asyncio.sleep(0.1)
    assert migrations.plans == []  # it waits, parked
    migrations.moving = frozenset()  # that migration failed on the old copy
    await until(lambda: handoff.num_handed_off == 1, loop)
    assert migrations.copies == [new] and engine.resumed == []
    await assert_cancels(loop)
    await handoff.close()


async def test_a_copy_whose_older_copys_migration_keeps_the_claim_past_hold_s_decodes_here():
    engine, runner, migrations, handoff = pushing_copies(hold_s=0.1)
    migrations.moving, migrations.claimed["r-1"] = frozenset({"r-1"}), runner.stream("r-1")
    runner.replace("r-1")
    loop = asyncio.create_task(handoff.handoff_loop())
    handoff.note_prefilled("r-1", parked(2))
    await until(lambda: engine.resumed == ["r-1"], loop)  # not left parked
    assert handoff.num_handed_off == 0 and "r-1" not in handoff._pending
    await assert_cancels(loop)
    await handoff.close()


async def test_a_prefill_instance_that_cannot_migrate_parks_nothing_and_says_so_once_per_role_change():
    """Without --transfer-address every MigrateOut here is refused. Before, each request was parked at its first token,
    placed on a decode instance (PlaceDecode), refused, reported as a failed migration and resumed, with a warning per
    hand-off; and a SetRole to PREFILL answered that every decoding request moves (`num_moving`) though none could."""
    engine, placer, migrations = FakeEngine(), FlakyPlacer(), FakeMigrations()
    migrations.can_migrate = False
    handoff = pushing(engine, placer, migrations)
    loop = asyncio.create_task(handoff.handoff_loop())
    with capture_logs() as logs:
        for request_id in ("r-1", "r-2", "r-3"):
            handoff.note_prefilled(request_id)
        assert not handoff.is_pushing  # the runner parks no first token
        await asyncio.sleep(0.05)
        engine.decoding_request_ids = lambda: ["r-1", "r-2", "r-3"]
        assert await handoff.move_decoding() == 0  # a SetRole to PREFILL again: nothing moves
        handoff.note_prefilled("r-4")
    assert engine.held == [] and placer.asks == [] and placer.failed == [] and migrations.plans == []
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["event"] for entry in warnings] == ["pd_handoff_off", "pd_handoff_off"]
    assert "--transfer-address" in warnings[0]["action"]
    # They decode here for good: none waits for a hand-off, so the manager's loop sends no MigrateOut (each would be
    # refused, recorded failed and backed off, over and over)
    assert handoff.num_prefilled({"r-1", "r-2"}) == 0
    await assert_cancels(loop)
    await handoff.close()
