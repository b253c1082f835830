"""The PD hand-off pushed by a prefill instance: each request moves to a decode instance as
soon as it has its first token (README "Prefill/decode disaggregation").

Design (`handoff_loop`: --max-concurrent-migrations workers, each one request at a time):

    first token delivered  →  hold it (parked at the next step boundary, blocks kept) and
    queue it  →  ask the leader for a decode instance (by load)  →  migrate it in one
    stop-and-copy stage  →  report the migration to the leader

A held request does not decode here, so the prefill instance spends its steps on prefills.
But a request parked in the queue for `hold_s` (--pd-handoff-hold-s) decodes here meanwhile,
so a client's pause between its first and second token stays about that long: under a burst
the workers move one request each at a time (with 60 arrivals at once the last waited 17 s
for its second token), and a hand-off to a frozen decode instance waits for its call's
deadline. A worker that takes one suspends it afresh; one that finished here meanwhile never
moves. A hand-off moves one copy of its request: a copy that took the id since (the frontend resumed the
request here) gets a hand-off of its own at its first token, also while the old one's still runs.
Nothing is dropped on the way: if no decode instance serves (PlaceDecode UNAVAILABLE) or the migration fails,
the request is resumed and keeps decoding here, and the manager's migration loop moves it
once a decode instance is back (it counts in the load report's `num_prefilled`).
With `--pd-handoff manager` this module only reports; the manager's loop moves everything.
An instance without a transfer service (no --transfer-address) cannot migrate: it parks and pushes nothing, and
says so once per role change (`pd_handoff_off`, at its first prefill and at each SetRole to PREFILL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from services.common.errors import FailedPrecondition, FerryError, NotFound, ResourceExhausted, Unavailable
from services.instance.config import InstanceRole, PdHandoff
from services.instance.engine.migration_state import HeldRequest, MigrationSelection
from services.instance.migration import MigrationDriver
from services.instance.migration_domain import MigrateOutPlan, MigrationResult, RefusedByDestination
from services.instance.request_stream import RequestStream
from services.instance.runner import EngineRunner

log = structlog.get_logger(__name__)

# A hand-off's MigrateOut tries: one that finds our migration slots busy waits a little (_SLOT_RETRY_S, growing),
# one the destination refused or that could not reach it (`_TRY_ANOTHER`) takes the next freest decode instance.
_NUM_TRIES = 4
_SLOT_RETRY_S = 0.05
# Failures another decode instance may not meet: no room there (RESOURCE_EXHAUSTED), its role is PREFILL now
# (FAILED_PRECONDITION: a SetRole while etcd was away, which the managers have not seen, so PlaceDecode still names
# it), or it died or froze (UNAVAILABLE: the managers name it until its lease expires, so under a burst every
# hand-off would fail on it and decode here). Each leaves the request here, so the next try is safe. Not a
# FAILED_PRECONDITION of this instance's own (no --transfer-address): every destination would meet it, so the
# hand-off ends at once.
_TRY_ANOTHER = (ResourceExhausted, RefusedByDestination, Unavailable)
_CLAIMED_RECHECK_S = 0.05  # how often a queued request another migration claimed is looked at past its hold time


@dataclass(frozen=True, slots=True)
class DecodePlace:
    """The decode instance a prefilled request moves to (PlaceDecodeResponse)."""

    instance_id: str
    address: str


class DecodePlacer(Protocol):
    """The leader manager's PD calls (services/instance/manager_client.py: ManagerLink)."""

    async def place_decode(self, request_id: str, src_instance_id: str, num_blocks: int,
                           refused: Collection[str] = (), max_num_tokens: int = 0) -> DecodePlace: ...

    async def report_migration(self, result: MigrationResult, started_at: float) -> None: ...

    async def report_failed_migration(self, plan: MigrateOutPlan, src_instance_id: str, error: FerryError,
                                      started_at: float) -> None: ...


class DecodeHandoff:
    def __init__(self, instance_id: str, runner: EngineRunner, migrations: MigrationDriver,
                 placer: DecodePlacer | None, mode: PdHandoff, role: Callable[[], InstanceRole],
                 num_workers: int = 1, hold_s: float = 1.0) -> None:
        self._instance_id = instance_id
        self._num_workers = num_workers
        self._hold_s = hold_s
        self._runner = runner
        self._migrations = migrations
        migrations.on_resumed = self._forget_held  # a parked request another migration resumed decodes on
        self._placer = placer  # None without etcd: nobody to ask, requests decode here
        self._mode = mode
        self._role = role
        self._queue: asyncio.Queue[str] = asyncio.Queue()  # request ids, each at most once while in `_queued`
        # Hand-offs queued or moving now (not reported as `num_prefilled`), each with the copy it moves: the
        # request's stream when it was queued. A copy that took the id since (a resume of the request here, a hand-off
        # back) replaces it: the id's queue entry, or a new one if a worker has the old copy, moves the new copy.
        self._pending: dict[str, RequestStream | None] = {}
        self._held: dict[str, HeldRequest] = {}  # parked in the step of their first token, with their state
        self._queued: dict[str, float] = {}  # in the queue, no worker on it yet: when its copy was queued
        self._decoding_while_queued: set[str] = set()  # resumed after hold_s parked: decoding here until a worker takes it
        self._wait_check: asyncio.TimerHandle | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self.is_decode_missing = False  # the last PlaceDecode found no decode instance
        self._has_said_off = False  # `pd_handoff_off` logged since the last role change
        self.num_handed_off = 0
        self.num_kept_for_lack_of_decode = 0

    @property
    def is_pushing(self) -> bool:
        return self._is_push_due and self._migrations.can_migrate

    @property
    def _is_push_due(self) -> bool:
        """Hand-offs are this instance's to push (whether it can migrate or not)."""
        return self._placer is not None and self._mode is PdHandoff.PUSH and self._role() is InstanceRole.PREFILL

    def _say_if_off(self) -> None:
        """Once per role change: hand-offs are due here but this instance cannot migrate."""
        if self._has_said_off or not self._is_push_due or self._migrations.can_migrate:
            return
        self._has_said_off = True
        log.warning("pd_handoff_off", reason="this prefill instance has no transfer service, so it cannot migrate",
                    action="prefilled requests decode here; start the instance with --transfer-address <host:port of "
                           "its co-located transfer service>")

    def num_prefilled(self, decoding_ids: Collection[str]) -> int:
        """Decoding requests waiting for a hand-off nobody runs yet (the manager's loop moves them):
        of the running requests past their prefill, those neither a hand-off here (queued, parked
        or decoding meanwhile, or moving) nor another migration handles. None on an instance that cannot
        migrate (no --transfer-address): they decode here, and every MigrateOut the loop sent would be refused."""
        if self._role() is not InstanceRole.PREFILL or not self._migrations.can_migrate:
            return 0
        return len(set(decoding_ids).difference(self._pending, self._migrations.moving))

    def _forget_held(self, request_id: str) -> None:
        self._held.pop(request_id, None)  # its hand-off, if still queued, suspends it afresh

    def note_prefilled(self, request_id: str, held: HeldRequest | None = None) -> None:
        """The request's first token was delivered (on the event loop): queue its hand-off.
        `held`: the runner parked it already, in the step that made the token."""
        engine, copy = self._runner.engine, self._runner.stream(request_id)
        self._say_if_off()
        if not self.is_pushing or (request_id in self._pending and self._pending[request_id] is copy):
            if held is not None:  # parked for a hand-off that will not run (the role changed since): decode here
                self._runner.call_soon(lambda: engine.resume(request_id))
            return
        self._pending[request_id] = copy  # a hand-off of an older copy (aborted since) is left to end by itself
        self._decoding_while_queued.discard(request_id)
        if held is not None:
            self._held[request_id] = held
        else:  # parked at the next step boundary: it decodes on the decode instance
            self._held.pop(request_id, None)  # (an older copy's)
            self._runner.call_soon(lambda: engine.hold(request_id))
        if request_id not in self._queued:  # else the older copy's queue entry, no worker on it yet, moves this one
            self._queue.put_nowait(request_id)
        self._queued[request_id] = time.monotonic()
        self._check_waits_in(self._hold_s)

    def _check_waits_in(self, delay_s: float) -> None:
        if self._wait_check is None:
            self._wait_check = asyncio.get_running_loop().call_later(delay_s, self._check_waits)

    def _check_waits(self) -> None:
        """Queued requests parked for `hold_s` decode here; check again when the next one will have waited that long."""
        self._wait_check = None
        if not self._queued:
            return
        now = time.monotonic()
        self._decode_here([r for r, queued_at in self._queued.items() if now - queued_at >= self._hold_s])
        # Still parked past its wait: another migration holds it (`_decode_here` left it): look again a little later,
        # not at once (that rescheduled itself without end, a busy event loop until the request was taken).
        waits = [queued_at + self._hold_s - now for r, queued_at in self._queued.items()
                 if r not in self._decoding_while_queued]
        if waits:
            self._check_waits_in(min(wait if wait > 0 else _CLAIMED_RECHECK_S for wait in waits))

    def _decode_here(self, waited: list[str]) -> None:
        """Resume those of `waited` still parked. Commands reach the engine in order, so a resume
        comes before the suspend of the worker that takes the request later."""
        parked = [r for r in waited if r not in self._decoding_while_queued
                  and not self._migrations.moves(self._pending.get(r))]  # (another migration's: not ours to resume)
        if parked:
            log.info("pd_handoff_queue_slow", num_resumed=len(parked), num_queued=len(self._queued),
                     hold_s=self._hold_s,
                     action="requests parked this long for their hand-off decode here until a worker takes it")
        for request_id in parked:
            self._decoding_while_queued.add(request_id)
            self._held.pop(request_id, None)  # stale once it decodes: its hand-off suspends it afresh
            self._runner.resume_soon(self._pending.get(request_id))

    def _take(self, request_id: str) -> RequestStream | None:
        """A worker starts the request's hand-off: it is no longer queued. The copy it moves."""
        self._queued.pop(request_id, None)
        self._decoding_while_queued.discard(request_id)
        return self._pending.get(request_id)

    def _end(self, request_id: str, copy: RequestStream | None) -> None:
        """A worker ended the hand-off of `copy`: no longer pending, unless a newer copy's is."""
        if request_id in self._pending and self._pending[request_id] is copy:
            del self._pending[request_id]

    async def move_decoding(self) -> int:
        """Queue every request decoding here (the role became PREFILL); how many."""
        self._has_said_off = False
        self._say_if_off()
        request_ids = await self._runner.call(lambda: self._runner.engine.decoding_request_ids())
        for request_id in request_ids:
            self.note_prefilled(request_id)
        return len(request_ids) if self.is_pushing else 0

    async def handoff_loop(self) -> None:
        """As many hand-offs at once as the migration slots allow (--max-concurrent-migrations)."""
        async with asyncio.TaskGroup() as workers:
            for n in range(self._num_workers):
                workers.create_task(self._worker_loop(), name=f"pd_handoff_worker_{n}")

    async def _worker_loop(self) -> None:
        while True:
            request_id = await self._queue.get()
            copy = self._take(request_id)
            try:
                await self._hand_off(request_id)
            except Exception:  # noqa: BLE001 — one request's failure must not stop the hand-offs (or the instance)
                log.exception("pd_handoff_crashed", request_id=request_id)
            finally:
                self._end(request_id, copy)

    async def close(self) -> None:
        if self._wait_check is not None:
            self._wait_check.cancel()
            self._wait_check = None
        for task in list(self._reports):
            task.cancel()
        await asyncio.gather(*self._reports, return_exceptions=True)

    async def _hand_off(self, request_id: str) -> None:
        held, copy = self._held.pop(request_id, None), self._pending.get(request_id)
        if not self._runner.owns(copy):
            return  # aborted meanwhile (and maybe resumed here: a copy this hand-off leaves alone)
        try:
            await self._wait_for_older_copys_migration(copy)
            result = await self._try_hand_off(copy, held) if self.is_pushing else None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # we are shutting down
            log.warning("pd_handoff_cancelled", request_id=request_id, action="it decodes here")  # a call cut under us
            result = None
        except Exception:  # noqa: BLE001 — unexpected (refusals are handled inside): it must not stay held
            log.exception("pd_handoff_crashed", request_id=request_id, action="it decodes here")
            result = None
        if result is None and not self._migrations.moves(copy):  # (another migration owns it otherwise)
            await self._runner.resume(copy)  # it decodes here after all

    async def _wait_for_older_copys_migration(self, copy: RequestStream) -> None:
        """A migration that claimed the id for an older copy (aborted since: a resume of the request here replaced
        it), its PD hand-off or another, keeps the claim until its next engine call or RPC ends; no migration of
        this copy can claim it until then. Wait for that, up to `hold_s`, this copy still parked."""
        deadline = time.monotonic() + self._hold_s
        while (copy.request_id in self._migrations.moving and not self._migrations.moves(copy)
               and time.monotonic() < deadline):
            await asyncio.sleep(_CLAIMED_RECHECK_S)

    async def _try_hand_off(self, copy: RequestStream, held: HeldRequest | None) -> MigrationResult | None:
        started_at, request_id = time.time(), copy.request_id
        try:
            # prompt + max_tokens: PlaceDecode passes over decode instances serving shorter sequences
            num_blocks, reach = ((held.blocks.num_blocks, held.state.max_num_tokens) if held is not None
                                 else await self._size(request_id))
        except NotFound:
            return None  # finished meanwhile
        try:
            place = await self._placer.place_decode(request_id, self._instance_id, num_blocks, max_num_tokens=reach)
        except FerryError as exc:
            self._note_decode_missing(request_id, exc)
            return None
        self._note_decode_back()
        plan = MigrateOutPlan(request_id=request_id, dst_instance_id=place.instance_id, dst_address=place.address,
                              dst_transfer_address="", backend=None, selection=MigrationSelection.PREFILL_DONE,
                              max_stages=0, held=held, prepare_timeout_s=self._hold_s)
        plan, outcome = await self._migrate(plan, copy, num_blocks, reach)
        if isinstance(outcome, FerryError):  # it decodes here; the manager's loop retries it
            if self._is_moot(copy):
                log.info("pd_handoff_moot", request_id=request_id, reason=outcome.message)
                return None
            _log_failed(plan, outcome)
            self._in_background(self._placer.report_failed_migration(plan, self._instance_id, outcome, started_at),
                                request_id)
            return None
        self.num_handed_off += 1
        self._in_background(self._placer.report_migration(outcome, started_at), request_id)
        return outcome

    async def _size(self, request_id: str) -> tuple[int, int]:
        """KV blocks the request holds now (PlaceDecode picks a decode instance with room for them) and the tokens
        it may reach; NotFound if it finished."""
        view = await self._runner.call(lambda: self._runner.engine.migration_blocks(request_id))
        return view.num_blocks, view.max_num_tokens

    def _is_moot(self, copy: RequestStream) -> bool:
        """The hand-off has nothing left to do: its request finished (decoding here while queued), was aborted
        (maybe resumed here since: another copy), or another migration (a drain, the manager's loop) claimed it
        first and moves it."""
        return not self._runner.owns(copy) or self._migrations.moves(copy)

    async def _migrate(self, plan: MigrateOutPlan, copy: RequestStream, num_blocks: int,
                       reach: int) -> tuple[MigrateOutPlan, MigrationResult | FerryError]:
        """Up to _NUM_TRIES tries; the last plan tried, with its result or its error. A destination that refused or
        could not be reached (`_TRY_ANOTHER`: no blocks or slots, its role, gone) is not tried again: the next try
        goes to the freest decode instance not tried. While our own migration slots are busy, a try waits a little."""
        refused: list[str] = []
        for attempt in range(1, _NUM_TRIES):
            if not self._migrations.has_free_slot:
                await asyncio.sleep(_SLOT_RETRY_S * attempt)  # the same destination, a little later
                continue
            outcome = await self._try(plan, copy)
            if not isinstance(outcome, _TRY_ANOTHER):
                return plan, outcome
            refused.append(plan.dst_instance_id)  # no room there (our slot was free), not a decode instance now, gone
            try:
                place = await self._placer.place_decode(plan.request_id, self._instance_id, num_blocks, refused,
                                                        max_num_tokens=reach)
            except FerryError:
                return plan, outcome  # none left not tried, or no leader answers: the failure stands
            # The failed attempt may have resumed the request (it decodes here meanwhile): its parked state is
            # stale, the next attempt suspends it afresh.
            plan = dataclasses.replace(plan, dst_instance_id=place.instance_id, dst_address=place.address, held=None)
        return plan, await self._try(plan, copy)

    async def _try(self, plan: MigrateOutPlan, copy: RequestStream) -> MigrationResult | FerryError:
        try:
            return await self._migrations.migrate_out(plan, copy=copy)
        except FerryError as exc:
            return exc

    def _note_decode_missing(self, request_id: str, exc: FerryError) -> None:
        self.num_kept_for_lack_of_decode += 1
        if not self.is_decode_missing:
            self.is_decode_missing = True
            # no decode instance serves, or the manager did not answer: `reason` says which
            log.warning("pd_handoff_unplaced", request_id=request_id, code=exc.grpc_code.name, reason=exc.message,
                        action="prefilled requests keep decoding on this prefill instance until the manager "
                               "places them")

    def _note_decode_back(self) -> None:
        if self.is_decode_missing:
            self.is_decode_missing = False
            log.info("pd_handoff_placed_again", num_kept=self.num_kept_for_lack_of_decode)

    def _in_background(self, report: Coroutine[Any, Any, None], request_id: str) -> None:
        """Send a hand-off's record to the manager's history without holding the hand-off up."""
        task = asyncio.create_task(self._report_quietly(report, request_id), name=f"report-{request_id}")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    @staticmethod
    async def _report_quietly(report: Coroutine[Any, Any, None], request_id: str) -> None:
        try:
            await report
        except FerryError as exc:  # only the history misses it
            log.warning("pd_handoff_report_failed", request_id=request_id, reason=exc.message)


def _log_failed(plan: MigrateOutPlan, error: FerryError) -> None:
    fields = {"request_id": plan.request_id, "dst_instance_id": plan.dst_instance_id, "code": error.grpc_code.name,
              "reason": error.message}
    if isinstance(error, FailedPrecondition) and not isinstance(error, RefusedByDestination):
        # this instance's own (no --transfer-address): another destination would meet it too, so none was tried
        log.warning("pd_handoff_failed", **fields, refused_by="this instance",
                    action="the request decodes here; the reason names what to change on this instance")
    else:
        log.info("pd_handoff_failed", **fields)
