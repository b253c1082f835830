"""Live migration from the manager's side: the migration loop and admin migrations; their pacing is in
migration_pacing.py, the history (and the journal's feed) in migration_records.py.

Design of `migration_loop` (every manager runs it; it acts only while leading):

    every tick:  peers that can take part  →  pairs (drains, then PD hand-offs, then the pairing policy)
                 →  one MigrateOut task per pair  →  announce instances a drain emptied

A migration holds a slot on both of its instances until MigrateOut returns (at most
`max_per_instance` at once on one instance); then both sit out until their next load
report (an older one still shows the request where it was): migration_pacing.py. Loads do not show a move in
flight either, so load moves stay one at a time per instance whatever `max_per_instance`
is (two at once overshot and swapped the pair); drains and PD hand-offs use the other slots. A request that committed
is left alone for `cooldown_s` (the source is told to skip it when it picks); with the
pairing's hysteresis (migration_policies.py) nothing ping-pongs. Drains move requests
whether or not the load-balancing loop is on. A MigrateOut failure is recorded, counted
by gRPC status and logged, and never ends the loop: the request runs on at the source,
and that (source, destination) pair waits `failure_backoff_s` before its next try. One refused
for want of room (RESOURCE_EXHAUSTED: the destination filled since the report it was picked on) is
recorded `refused`, not `failed` (no fault), and backs its pair off the same (the next-freest
destination gets the next try); one where a transfer service's staging slots stayed busy (the source
says which party ran out: x-ferry-refused-by) is `failed`. One the
source never answered (UNAVAILABLE, DEADLINE_EXCEEDED) may have committed: unless the
destination holds the request at once, it is kept (and journaled) as `unknown` and found out
later, while this manager leads (migration_settle.py), and counted then. One that never
reached the source (connection refused) is failed at once. A source reporting no free
migration slot (its own PD hand-offs hold them) is asked for none; one that refuses at once all
the same (SourceBusy) made no migration: counted apart, no record, no backoff. A MigrateOut still
running at close() (shutdown) is kept `unknown`. Records (migration_records.py) go to the journal only while
this manager leads in the term their migration began in; those an earlier term left `unknown` there are adopted
and settled from the first tick of each term (migration_adopt.py). A tick that raises (a bug, a
race in the view) is logged and the next tick runs (`periodic_loop`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.common.errors import FerryError, ResourceExhausted
from services.common.periodic import periodic_loop
from services.common.pick_announcement import AnnouncedPick
from services.common.task_errors import read_error
from services.manager import metrics
from services.manager.admin_orders import AdminOrders
from services.manager.migration_accounting import note_source_busy
from services.manager.migration_adopt import Adopter, UnknownRecords
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceId, InstanceState, InstanceView, Role
from services.manager.leadership import Leadership
from services.manager.migration import (MigrationFigures, MigrationOrder, MigrationOutcome, MigrationRecord,
                                        MigrationSelection, MigrationSettings, MigrationTrigger, SourceBusy,
                                        TransferBusy)
from services.manager.migration_pacing import MigrationPacing
from services.manager.migration_records import MigrationRecords, RecordSink
from services.manager.migration_settle import (LOOKS_AT_S, UNANSWERED_STATUSES, HeldRequest, SourceUnanswered,
                                               SourceUnreached)
from services.manager.migration_policies import (Pair, PairingPolicy, Peer, blocks_per_request, make_pairing,
                                                 pair_drains, pair_prefilled)

log = structlog.get_logger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class MigratorLimits:
    interval_s: float = 0.5  # seconds between ticks of the migration loop
    max_per_instance: int = 1  # migrations one instance takes part in at once (either side)
    cooldown_s: float = 10.0  # a request that just migrated is not picked again for this long
    timeout_s: float = 60.0  # deadline of one MigrateOut call
    history_size: int = 256  # migration records kept (the oldest go first)
    failure_backoff_s: float = 2.0  # a (source, destination) pair whose migration failed is not tried again sooner
    backend: str = ""  # transfer backend asked for; empty: each source's default
    settle_looks_at_s: tuple[float, ...] = LOOKS_AT_S  # when an unanswered migration's instances are asked again


class MigrateOutClient(Protocol):
    async def migrate_out(self, order: MigrationOrder, timeout_s: float,
                          on_picked: Callable[[AnnouncedPick], None]) -> MigrationFigures:
        """Run the migration on the source; FerryError (cause: the gRPC error) if it was not committed:
        SourceUnanswered (with the pick the source announced) if it gave no answer, SourceUnreached if the
        call never reached it. `on_picked`: told the pick as soon as the source announces it."""

    async def held_request(self, address: str, request_id: str, timeout_s: float) -> HeldRequest | None:
        """The request on the instance, unfinished, and how it came there; None if it has none."""


DEFAULT_SETTINGS = MigrationSettings()
OWED_TRIGGERS = (MigrationTrigger.DRAIN, MigrationTrigger.PD)  # requests that must move, whatever the load
OWED_WORK_INTERVAL_S = 0.05  # ticks while such migrations run (each order still waits for its pair to settle)
OWED_SETTLE_S = 1.0  # ... and this long after the last one ended, for the pair's fresh load reports
CUT_SHORT = ("this manager stopped while MigrateOut ran; the source runs it on (ListRequests shows where the "
             "request is)")


class Migrator:
    def __init__(self, view: ClusterView, leadership: Leadership, client: MigrateOutClient, limits: MigratorLimits,
                 settings: MigrationSettings = DEFAULT_SETTINGS, clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time,
                 record_sink: RecordSink | None = None, journaled: UnknownRecords | None = None) -> None:
        self._view = view
        self._leadership = leadership
        self._client = client
        self._limits = limits
        self._clock = clock  # the view's clock (report ages are measured with it)
        self._wall_clock = wall_clock
        self._settings = settings
        self._pairing: PairingPolicy = make_pairing(settings.pairing)
        self._pacing = MigrationPacing(limits.max_per_instance, limits.cooldown_s, limits.failure_backoff_s, clock)
        # The history, the journal's feed (`record_sink`), the unanswered ones followed till settled
        self._records = MigrationRecords(limits.history_size, leadership, client, limits.settle_looks_at_s,
                                         record_sink, on_counted=self._counted)
        self._tasks: set[asyncio.Task[None]] = set()
        self._announced_drained: set[InstanceId] = set()
        self._admin_orders = AdminOrders(view, self._peer)
        # The unknown ones an earlier term left in the journal (`journaled`), settled once this manager leads
        self._adopter = Adopter(journaled, client, leadership, self._address_of, record_sink,
                                limits.settle_looks_at_s) if journaled is not None else None

    @property
    def settings(self) -> MigrationSettings:
        return self._settings

    def set_settings(self, settings: MigrationSettings) -> None:
        """Switch settings (ValueError for an unknown pairing)."""
        if settings == self._settings:
            return
        if settings.pairing != self._pairing.name:
            self._pairing = make_pairing(settings.pairing)
        self._settings = settings
        log.info("migration_policy_changed", enabled=settings.is_enabled, threshold=settings.threshold,
                 selection=settings.selection.value, pairing=settings.pairing)

    # the loop

    async def migration_loop(self) -> None:
        await periodic_loop("migration_loop", self._next_interval_s, self._tick_if_leading)

    def _next_interval_s(self) -> float:
        """The tick interval, or OWED_WORK_INTERVAL_S while drains or PD hand-offs are moving requests:
        those must move whatever the load, so the next goes as soon as its pair settled, not a tick later.
        A drain with nowhere to go (no destination, or backing off) starts nothing and keeps the usual pace."""
        is_moving = self._pacing.is_moving_owed(OWED_SETTLE_S)
        return min(self._limits.interval_s, OWED_WORK_INTERVAL_S) if is_moving else self._limits.interval_s

    async def _tick_if_leading(self) -> None:
        if self._leadership.is_leader:
            if self._adopter is not None:
                self._adopter.adopt_once_per_term()
            self.tick()

    def tick(self) -> list[MigrationOrder]:
        """Plan this tick's migrations and start them (each in its own task)."""
        orders = self.plan()
        for order in orders:
            self._start(order)
        self._announce_drained()
        self._pacing.cooled_request_ids()  # forgets the cooled-down ones, also while no load order asks
        self._pacing.forget_departed(self._view.has_member)
        return orders

    def plan(self) -> list[MigrationOrder]:
        peers = self._peers()
        serving = [p for p in peers if not p.is_draining]
        def allowed(src: Peer, dst: Peer) -> bool:  # one that keeps refusing leaves the next-freest one to try
            return src.holds_same_model(dst) and self._pacing.is_not_backing_off(src.instance_id, dst.instance_id)
        pairs = pair_drains([p for p in peers if p.is_draining], serving, allowed,
                            may_use_prefill=not self._is_a_decoder_sitting_out(peers))
        pairs += pair_prefilled([p for p in serving if p.instance_id not in _taken(pairs)], allowed)
        if self._settings.is_enabled:  # loads do not show a move in flight yet: a busy peer sits load moves out
            pairs += self._pairing.pair([p for p in serving if p.instance_id not in _taken(pairs)
                                         and not self._pacing.is_busy(p.instance_id)],
                                        self._settings.threshold, allowed)
        return [self._order(pair) for pair in pairs]

    # one migration

    async def migrate(self, order: MigrationOrder) -> MigrationRecord:
        """Run `order` to its end and keep its record; re-raises the source's error if it failed. A refusal of
        the source's own busy slots (SourceBusy) keeps none; one cut short by close() is kept `unknown`, with
        the request and the migration id its source announced (if it did). The journal gets the record only
        while this manager still leads in the term the migration began in (a manager that lost the lead
        meanwhile writes nothing: the history there is the new leader's)."""
        started, started_at, term = self._clock(), self._wall_clock(), self._records.leading_term()
        token = self._hold(order)
        has_run, picks = True, []  # what the source announced (its pick, the migration's id) as it came
        try:
            record, error = await self._outcome(order, started, started_at, picks.append)
        except SourceBusy as exc:
            has_run = False
            note_source_busy(order, exc)
            raise
        except asyncio.CancelledError:  # close(): this manager stops, the source runs it on
            picked = picks[-1] if picks else AnnouncedPick()
            figures = MigrationFigures(order.request_id or picked.request_id, migration_id=picked.migration_id,
                                       duration_ms=(self._clock() - started) * 1e3)
            self._keep(MigrationRecord(order, MigrationOutcome.UNKNOWN, figures, started_at, reason="CANCELLED",
                                       message=CUT_SHORT), term, is_followed=False)
            raise
        finally:
            self._release(order, token, has_run)
        self._keep(record, term)
        if error is not None:
            raise error
        return record

    async def _outcome(self, order: MigrationOrder, started: float, started_at: float,
                       on_picked: Callable[[AnnouncedPick], None]) -> tuple[MigrationRecord, FerryError | None]:
        """MigrateOut's record, and its error where it did not commit (SourceBusy: raised, no record)."""
        try:
            figures = await self._client.migrate_out(order, self._limits.timeout_s, on_picked)
        except SourceBusy:
            raise
        except FerryError as exc:
            elapsed_ms = (self._clock() - started) * 1e3
            migration_id = exc.migration_id if isinstance(exc, SourceUnanswered) else ""
            figures = MigrationFigures(order.request_id or exc.request_id, duration_ms=elapsed_ms,
                                       migration_id=migration_id)
            # it may have committed (a call that never reached the source started nothing)
            is_unanswered = status_name(exc) in UNANSWERED_STATUSES and not isinstance(exc, SourceUnreached)
            outcome = (MigrationOutcome.UNKNOWN if is_unanswered
                       else MigrationOutcome.not_committed(status_name(exc), isinstance(exc, TransferBusy)))
            not_committed = MigrationRecord(order, outcome, figures, started_at, reason=status_name(exc),
                                            message=exc.message)
            if not (is_unanswered and await self._records.moved_at_once(not_committed)):
                return not_committed, exc
            return MigrationRecord(order, MigrationOutcome.COMMITTED, figures, started_at, message=(
                f"the source gave no answer ({exc.message}), but the destination holds the request")), None
        return MigrationRecord(order, MigrationOutcome.COMMITTED, figures, started_at), None

    async def migrate_to_the_end(self, order: MigrationOrder) -> MigrationRecord:
        """`migrate` in a task of its own: a caller that gives up (an admin client's deadline) does not
        cut the migration short, and its record is kept however it ends. A refusal for want of room
        (RESOURCE_EXHAUSTED, recorded `refused`) says so, and where the destination reported no free migration
        slot (an operator may name such a one: it is tried) that too; one where a transfer service had no free
        staging slot (TransferBusy, recorded `failed`) names the transfer service, not the destination."""
        is_dst_busy = (self._view.has_member(order.dst_instance_id)
                       and not self._view.instance(order.dst_instance_id).load.has_free_migration_slot)
        try:
            return await asyncio.shield(self._start(order))
        except TransferBusy as exc:
            raise TransferBusy(f"a transfer service, not destination instance {order.dst_instance_id}, refused the "
                               f"migration: {exc.message} (recorded failed: the request runs on at "
                               f"{order.src_instance_id})", exc.request_id) from exc
        except ResourceExhausted as exc:
            if isinstance(exc, SourceBusy):
                raise
            busy = (" (it reported no free migration slot: its own migrations in or out hold its "
                    "--max-concurrent-migrations; retry when they end, or name another dst_instance_id, or none for "
                    "the freest instance with room)") if is_dst_busy else ""
            raise ResourceExhausted(f"destination instance {order.dst_instance_id} refused the migration: "
                                    f"{exc.message}{busy} (recorded refused: the request runs on at "
                                    f"{order.src_instance_id})", exc.request_id) from exc

    def admin_order(self, src_id: str, dst_id: str, request_id: str) -> MigrationOrder:
        """An AdminService.Migrate order (admin_orders.py has the checks)."""
        return self._admin_orders.order(src_id, dst_id, request_id, self._settings.selection, self._limits.backend)

    def busiest_source(self, dst_id: str = "") -> str:
        return self._admin_orders.busiest_source(dst_id)

    def keep_reported(self, record: MigrationRecord) -> None:
        """A migration an instance ran on its own (the PD push): kept, counted and logged like ours. One that
        failed does not hold back our own next try for that pair (its push often just met a busy slot)."""
        self._keep(record, self._records.leading_term(), backs_off=False)

    def history(self, instance_id: str = "", request_id: str = "") -> list[MigrationRecord]:
        """Kept records, oldest first, optionally only those of one instance or one request."""
        return self._records.history(instance_id, request_id)

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop (shutdown): MigrateOut calls still running get `grace_s` to end, then are cut short and kept
        `unknown` (their sources run them on); the journal gets those records while this manager leads (flush it
        before resigning)."""
        if self._tasks and grace_s > 0:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._records.close()
        if self._adopter is not None:
            await self._adopter.close()

    # internals

    def _peers(self) -> list[Peer]:
        """Instances that can take part now: reported, not unhealthy, not at their limit, settled."""
        now = self._clock()
        peers = []
        for view in self._view.instances():
            instance_id = view.record.instance_id
            if view.state is InstanceState.UNHEALTHY or view.report_age_s is None or not view.is_heard:
                continue  # (a draining instance gone silent shows DRAINING: its MigrateOut would only hang)
            if self._pacing.is_at_limit(instance_id):
                continue
            if self._pacing.is_waiting_for_report(instance_id, reported_at=now - view.report_age_s):
                continue
            peers.append(self._peer(view))
        return peers

    def _is_a_decoder_sitting_out(self, peers: list[Peer]) -> bool:
        """Whether a serving instance that decodes is no peer this tick (a migration of ours holds it, or it waits
        for its next report after one): a drain waits for it rather than send its requests to a PREFILL one."""
        ids = {p.instance_id for p in peers}
        return any(v.state is InstanceState.SERVING and v.record.role is not Role.PREFILL and v.is_heard
                   and v.record.instance_id not in ids for v in self._view.instances())

    def _peer(self, view: InstanceView) -> Peer:
        return Peer.of(view, is_draining=view.state is InstanceState.DRAINING,
                       last_received_at=self._pacing.last_received_at(view.record.instance_id))

    def _order(self, pair: Pair) -> MigrationOrder:
        if pair.trigger is MigrationTrigger.PD:  # one stop-and-copy stage of a request with its first token
            return MigrationOrder(pair.src.instance_id, pair.src.address, pair.dst.instance_id, pair.dst.address,
                                  pair.trigger, MigrationSelection.PREFILL_DONE, backend=self._limits.backend,
                                  max_stages=0, dst_max_model_len=pair.dst.max_model_len)
        excluded = frozenset() if pair.trigger is MigrationTrigger.DRAIN else self._pacing.cooled_request_ids()
        return MigrationOrder(pair.src.instance_id, pair.src.address, pair.dst.instance_id, pair.dst.address,
                              pair.trigger, self._settings.selection, backend=self._limits.backend,
                              exclude_request_ids=excluded, dst_max_model_len=pair.dst.max_model_len,
                              can_decode_on_prefill=pair.dst.role is Role.PREFILL)  # a drain's last resort

    def _start(self, order: MigrationOrder) -> asyncio.Task[MigrationRecord]:
        task = asyncio.get_running_loop().create_task(self.migrate(order), name=f"migrate:{order.src_instance_id}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if order.trigger in OWED_TRIGGERS:  # counted from here, so the tick that started it already sees it
            self._pacing.begin_owed()
            task.add_done_callback(lambda _: self._pacing.end_owed())
        return task

    def _task_done(self, task: asyncio.Task[MigrationRecord]) -> None:
        self._tasks.discard(task)
        error = read_error(task)  # a FerryError is recorded, counted and logged by migrate()
        if error is not None and not isinstance(error, FerryError):
            log.error("migration_crashed", task=task.get_name(), exc_info=error)

    def _hold(self, order: MigrationOrder) -> int:
        """A slot on both; the destination's view counts the request (an average one of the source's) till a
        report of it does. The view's token of it."""
        self._pacing.hold(order)
        metrics.MIGRATIONS_IN_FLIGHT.inc()
        is_known = self._view.has_member(order.src_instance_id)
        num_blocks = blocks_per_request(self._view.instance(order.src_instance_id).held_load) if is_known else 0
        return self._view.begin_migration(order.src_instance_id, order.dst_instance_id, num_blocks)

    def _release(self, order: MigrationOrder, token: int, has_run: bool = True) -> None:
        """Both sit out until their next report; only the source where it refused at once (`has_run` False:
        its next report shows its migration slots; the destination saw nothing)."""
        self._pacing.release(order, has_run)
        self._view.end_migration(order.src_instance_id, order.dst_instance_id, token)
        metrics.MIGRATIONS_IN_FLIGHT.dec()

    def _keep(self, record: MigrationRecord, term: int | None, backs_off: bool = True,
              is_followed: bool = True) -> None:
        """Kept (migration_records.py); one not committed backs its pair off (`backs_off`)."""
        if not record.is_committed and backs_off:
            self._pacing.note_failed(record.order.src_instance_id, record.order.dst_instance_id)
        self._records.keep(record, term, is_followed)

    def _counted(self, record: MigrationRecord) -> None:
        """Told once per migration as it is counted: a committed request cools down."""
        if record.is_committed:
            self._pacing.note_committed(record.figures.request_id)

    def _announce_drained(self) -> None:
        drained = {v.record.instance_id for v in self._view.instances() if v.is_drained}
        for instance_id in sorted(drained - self._announced_drained):
            log.info("instance_drained_empty", instance_id=instance_id)
        self._announced_drained = drained

    def _address_of(self, instance_id: str) -> str:
        return self._view.instance(InstanceId(instance_id)).record.address if self._view.has_member(instance_id) else ""


def _taken(pairs: list[Pair]) -> set[InstanceId]:
    return {i for pair in pairs for i in (pair.src.instance_id, pair.dst.instance_id)}


def status_name(error: FerryError) -> str:
    """The gRPC status a failed call ended with (UNIMPLEMENTED included), else the error's own code."""
    code = getattr(error.__cause__, "code", None)
    return code().name if callable(code) else error.grpc_code.name
