"""The manager's picture of the cluster: who is there (etcd), how loaded (ReportLoad), in what state.

Membership comes from the etcd MembershipView of instances/ (replaced wholesale on each
resync, patched by watch events in between). Load comes from the instances' ReportLoad
streams: the view keeps the last report of each instance and when it arrived. The state
of an instance is derived, never stored:

* DRAINING  — an operator drained it (mark kept in etcd config/), or its record says so;
* UNHEALTHY — its last report (or, before the first one, its first sighting) is older
              than `report_timeout_s`, or a peer could not reach it since its last report
              (`mark_unanswered`: a PD hand-off to it failed UNAVAILABLE, or its report
              stream ended, as when the process is killed; a live
              instance reports again within its report interval, a dead one's lease ends
              meanwhile);
* SERVING   — otherwise.

Dispatch picks SERVING instances that can prefill (a DECODE instance only when no prefill
instance serves, or for a short prompt; PlaceDecode picks DECODE instances). Each dispatch (and
each PD placement) is counted at once as a reservation on the chosen instance (+1 running, + its
prompt blocks needed), until a report of that instance counts the request itself. A report says
how many requests the instance has taken in since it started, by Generate
(`num_requests_admitted`) and by migrations in (`num_requests_migrated_in`); one whose first
count rose by d since the last report on its stream drops the d oldest dispatch reservations
(the second count: PD placements'), so a request is never counted twice. Those it does not count
yet stay: a request dispatched just before a report may not have reached the instance yet (the
frontend still has to send it), and dropping its reservation then made a burst pile onto one
instance, the one that had just reported. A report also drops the reservations made
`IN_TRANSIT_S` or more before it (a dispatch whose request never came), and that is all an
instance that does not count (0, an older one) gets. The counts are read as differences only
within one report stream (a restarted instance starts them again). So a burst of dispatches
spreads out instead of piling on one instance, and a request counts once from its instance's
first report of it. A migration this manager starts into an instance is counted there the same way
(a running request, the source's average request's blocks, and a migration slot) until a report of
that instance shows it (migrating in, or migrated in) or the migration ends (incoming_migrations.py).

No transport here: the server feeds records and reports in, the clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.manager.domain import (
    PREFILL_ROLES, Candidate, InstanceId, InstanceRecord, InstanceState, InstanceView, Load, Reservation, Role,
    migrations_within, pooled_freeness,
)
from services.manager.incoming_migrations import IncomingMigrations

IN_TRANSIT_S = 0.5  # a dispatched request reaches its instance, and is counted in its reports, within this

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class ClusterTotals:
    num_instances: int
    num_serving: int
    num_draining: int
    num_unhealthy: int
    num_running: int
    num_waiting: int
    average_freeness: float  # over serving instances; 0 when none serves
    num_dispatched: int


@dataclass(frozen=True, slots=True)
class _Reserved:
    """A request placed on an instance that its reports do not count yet."""

    at: float  # when it was reserved (the view's clock)
    num_blocks: int
    is_dispatch: bool  # a new request, sent by Generate; else a PD placement, which comes by a migration in


class ClusterView:
    def __init__(self, report_timeout_s: float, clock: Clock = time.monotonic) -> None:
        self._report_timeout_s = report_timeout_s
        self._clock = clock
        self._records: dict[InstanceId, InstanceRecord] = {}
        self._sorted_ids: list[InstanceId] = []  # invariant: sorted(self._records); ties break by id
        self._heard_at: dict[InstanceId, float] = {}  # members only: last report, or first sighting before one
        self._reports: dict[InstanceId, Load] = {}  # last report of each instance
        self._reserved: dict[InstanceId, list[_Reserved]] = {}  # not yet reported; oldest first
        self._counts_seen: dict[InstanceId, tuple[int, int]] = {}  # (num_requests_admitted,
        #   num_requests_migrated_in) of the last report on the current stream (none: the next report's are a
        #   baseline, not differences)
        self._drained: set[InstanceId] = set()  # operator drain marks (may name absent instances)
        self._unanswered: set[InstanceId] = set()  # a peer could not reach it; until its next report
        # Members first seen after this term began, over a membership known then: a live process registered each
        # (a dead one's key outliving it is older). None: not leading, or the membership was not read yet then.
        self._joined_in_term: set[InstanceId] | None = None
        self._num_dispatched: dict[InstanceId, int] = {}  # members only
        self._num_dispatched_to_departed = 0  # so the cluster's total stays cumulative
        self._migrating: dict[InstanceId, int] = {}  # migrations this manager runs into or out of each instance now
        self._incoming = IncomingMigrations()  # ... those into each, in its load until a report shows them
        # Dispatch runs hundreds of times a second over every member, so two caches:
        self._eligible_ids: list[InstanceId] = []  # sorted members that are not draining (any role);
        #   rebuilt on every membership or drain change
        self._candidates: dict[InstanceId, Candidate] = {}  # dropped on each report, reservation, record change

    # membership (from etcd)

    def replace_members(self, records: Iterable[InstanceRecord]) -> None:
        """Make the members exactly `records` (a full resync); keeps what is known of survivors."""
        fresh = {r.instance_id: r for r in records}
        for instance_id in set(self._records) - set(fresh):
            self.remove_member(instance_id)
        for record in fresh.values():
            self.put_member(record)

    def put_member(self, record: InstanceRecord) -> None:
        old = self._records.get(record.instance_id)
        if old == record:
            return
        self._records[record.instance_id] = record
        self._candidates.pop(record.instance_id, None)
        if old is None:
            self._heard_at[record.instance_id] = self._clock()
            self._sorted_ids = sorted(self._records)
            if self._joined_in_term is not None:
                self._joined_in_term.add(record.instance_id)
        self._rebuild_eligible()

    def remove_member(self, instance_id: InstanceId) -> None:
        if self._records.pop(instance_id, None) is None:
            return
        self._sorted_ids = sorted(self._records)
        for per_instance in (self._heard_at, self._reports, self._reserved, self._candidates, self._counts_seen):
            per_instance.pop(instance_id, None)
        self._incoming.forget(instance_id)
        if self._joined_in_term is not None:
            self._joined_in_term.discard(instance_id)
        self._num_dispatched_to_departed += self._num_dispatched.pop(instance_id, 0)
        self._unanswered.discard(instance_id)
        self._rebuild_eligible()

    def has_member(self, instance_id: str) -> bool:
        return instance_id in self._records

    def has_reported(self, instance_id: InstanceId) -> bool:
        """Whether the instance reported its load in this term (else it is in its first grace)."""
        return instance_id in self._reports

    def is_vouched_for(self, instance_id: InstanceId) -> bool:
        """Whether the instance is known to live: it reported in this term, or registered during it (a process
        just started, still in its first grace: taken as idle). Not a member left from before the term that has
        not reported yet: it may be a dead instance whose key outlives it."""
        return instance_id in self._reports or instance_id in (self._joined_in_term or ())

    def record(self, instance_id: InstanceId) -> InstanceRecord:
        return self._records[instance_id]

    def member_ids(self) -> list[InstanceId]:
        return list(self._sorted_ids)

    # load (from ReportLoad streams)

    def apply_report(self, instance_id: InstanceId, load: Load) -> float:
        """Keep `load` as the instance's last report; the reservations of the requests it counts go (see the
        module's doc). A report from an id that is not a member (not registered yet, gone, or made up:
        ReportLoad takes any id) is not kept; the next one counts.
        When it came (the clock's time), kept or not: for `note_report_stream_ended`."""
        if instance_id not in self._records:
            return self._clock()
        self._reports[instance_id] = load
        num_dispatches, num_migrated_in = self._num_newly_counted(instance_id, load)
        self._drop_counted_reservations(instance_id, num_dispatches, num_migrated_in)
        self._incoming.note_report(instance_id, load.num_incoming_migrations + num_migrated_in)
        self._candidates.pop(instance_id, None)
        self._unanswered.discard(instance_id)
        self._heard_at[instance_id] = heard_at = self._clock()
        return heard_at

    def note_report_stream_ended(self, instance_id: InstanceId, last_heard_at: float) -> None:
        """The stream whose last report came at `last_heard_at` ended: UNHEALTHY until the next report,
        unless one was kept since (on the stream that replaced it). Also when that last report was not
        kept (the id was no member then: its lease was lost) and the instance registered again since.
        The next stream's first count is a baseline (the instance may have restarted under its id)."""
        if instance_id not in self._reports or self._heard_at[instance_id] <= last_heard_at:
            self.mark_unanswered(instance_id)
            self._counts_seen.pop(instance_id, None)

    def _num_newly_counted(self, instance_id: InstanceId, load: Load) -> tuple[int, int]:
        """How many more requests `load` says the instance took in, by Generate and by migrations in, than its
        last report on this stream did; 0 where that is not known: the stream's first report, an instance
        that does not count (always 0), or a count that went down (the instance restarted under its id: the
        count is the new baseline)."""
        counts = (load.num_requests_admitted, load.num_requests_migrated_in)
        seen = self._counts_seen.get(instance_id)
        self._counts_seen[instance_id] = counts
        if seen is None:
            return 0, 0
        return max(0, counts[0] - seen[0]), max(0, counts[1] - seen[1])

    def _drop_counted_reservations(self, instance_id: InstanceId, num_dispatches: int, num_placements: int) -> None:
        """Drop the `num_dispatches` oldest dispatch reservations and the `num_placements` oldest PD placement
        ones (at most those there are: requests sent without the manager, as by a frontend's local fallback,
        and migrations it did not place have none), and any made `IN_TRANSIT_S` or more ago."""
        in_transit_since = self._clock() - IN_TRANSIT_S
        kept = []
        for reserved in self._reserved.pop(instance_id, ()):
            if reserved.is_dispatch and num_dispatches:
                num_dispatches -= 1
            elif not reserved.is_dispatch and num_placements:
                num_placements -= 1
            elif reserved.at > in_transit_since:
                kept.append(reserved)
        if kept:
            self._reserved[instance_id] = kept

    def begin_migration(self, src_id: InstanceId, dst_id: InstanceId, num_blocks: int = 0) -> int:
        """A migration this manager started: neither instance is drained before it ends. Their reports may
        show the request on neither: the destination's not the reservation yet, the source's not the
        request it took out of its batch for the last stage. Until a report of the destination shows it, it
        holds there a running request, `num_blocks` (an estimate) and a migration slot (incoming_migrations.py).
        Its token, for `end_migration`."""
        for instance_id in (src_id, dst_id):
            self._migrating[instance_id] = self._migrating.get(instance_id, 0) + 1
        self._candidates.pop(dst_id, None)
        return self._incoming.begin(dst_id, num_blocks, src_id)

    def end_migration(self, src_id: InstanceId, dst_id: InstanceId, token: int = 0) -> None:
        self._incoming.end(dst_id, token)
        self._candidates.pop(dst_id, None)
        for instance_id in (src_id, dst_id):
            if (count := self._migrating.get(instance_id, 0) - 1) > 0:
                self._migrating[instance_id] = count
            else:
                self._migrating.pop(instance_id, None)

    def mark_unanswered(self, instance_id: InstanceId) -> None:
        """A peer could not reach the instance (a hand-off to it failed UNAVAILABLE) or its report stream
        ended: UNHEALTHY until it reports again, so placements stop going to an instance that died
        until its lease ends."""
        if instance_id in self._records:
            self._unanswered.add(instance_id)
            self._candidates.pop(instance_id, None)

    def start_leading(self, is_membership_read: bool = True) -> None:
        """Forget reports from an earlier term and give every member a fresh grace to report to us. Members that
        register from now on are vouched for before their first report (`is_vouched_for`), if the membership was
        read already (`is_membership_read`; else those seen first from now on may be old keys of dead instances)."""
        now = self._clock()
        self._joined_in_term = set() if is_membership_read else None
        self._reports.clear()
        self._reserved.clear()
        self._counts_seen.clear()
        self._candidates.clear()
        self._unanswered.clear()
        self._heard_at = {instance_id: now for instance_id in self._records}

    # drain marks (from etcd config/drain/)

    def replace_drained(self, instance_ids: Iterable[InstanceId]) -> None:
        self._drained = set(instance_ids)
        self._rebuild_eligible()

    def mark_drained(self, instance_id: InstanceId) -> None:
        self._drained.add(instance_id)
        self._rebuild_eligible()

    def has_drain_mark(self, instance_id: str) -> bool:
        return instance_id in self._drained

    def unmark_drained(self, instance_id: InstanceId) -> None:
        self._drained.discard(instance_id)
        self._rebuild_eligible()

    # derived state

    def state_of(self, instance_id: InstanceId) -> InstanceState:
        if self._is_draining(instance_id):
            return InstanceState.DRAINING
        if self._is_unhealthy(instance_id, self._clock() - self._report_timeout_s):
            return InstanceState.UNHEALTHY
        return InstanceState.SERVING

    def _is_unhealthy(self, instance_id: InstanceId, heard_since: float) -> bool:
        """Silent since `heard_since` (now minus the report timeout), or unreachable since its last report."""
        return self._heard_at[instance_id] < heard_since or instance_id in self._unanswered

    def load_of(self, instance_id: InstanceId) -> Load:
        """Last reported load plus reservations (dispatches, migrations in); before any report, an empty cache of
        the record's size."""
        reserved = self._reserved.get(instance_id, ())
        dispatched = Reservation(len(reserved), sum(r.num_blocks for r in reserved))
        return self.reported_load_of(instance_id).plus(dispatched + self._incoming.reservation(instance_id))

    def reported_load_of(self, instance_id: InstanceId) -> Load:
        """Last reported load; before any report, an empty cache of the record's size."""
        load = self._reports.get(instance_id)
        if load is None:
            num_blocks = self._records[instance_id].num_blocks
            load = Load(num_free_blocks=num_blocks, num_total_blocks=num_blocks)
        return load

    def candidates(self, exclude: frozenset[InstanceId] = frozenset(),
                   roles: frozenset[Role] = PREFILL_ROLES) -> list[Candidate]:
        """Serving instances with one of `roles` (default: prefill-capable), not in `exclude`, sorted by id."""
        heard_since = self._clock() - self._report_timeout_s
        out = []
        for instance_id in self._eligible_ids:
            if (instance_id in exclude or self._is_unhealthy(instance_id, heard_since)
                    or self._records[instance_id].role not in roles):
                continue
            candidate = self._candidates.get(instance_id)
            if candidate is None:
                candidate = Candidate.of(instance_id, self._records[instance_id].address, self.load_of(instance_id))
                self._candidates[instance_id] = candidate
            out.append(candidate)
        return out

    def explain_no_candidate(self, exclude: frozenset[InstanceId] = frozenset()) -> str:
        """Why `candidates(exclude)` is empty, in words an operator can act on."""
        if not self._records:
            return "no instance is registered in etcd (start one with python -m services.instance --etcd-endpoints ...)"
        counts: dict[str, int] = {}
        for instance_id in self._sorted_ids:
            if instance_id in exclude:
                reason = "excluded by the caller"
            else:
                reason = self.state_of(instance_id).value
            counts[reason] = counts.get(reason, 0) + 1
        detail = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
        return f"no serving instance to dispatch to ({len(self._records)} registered: {detail})"

    # dispatch bookkeeping

    def reserve(self, instance_id: InstanceId, num_blocks: int, is_dispatch: bool = True) -> None:
        """Count a request just sent to `instance_id` until a report of it counts the request; a new
        request (`is_dispatch`, not a PD hand-off's) also counts in `num_dispatched`."""
        self._reserved.setdefault(instance_id, []).append(_Reserved(self._clock(), num_blocks, is_dispatch))
        if is_dispatch:
            self._num_dispatched[instance_id] = self._num_dispatched.get(instance_id, 0) + 1
        self._candidates.pop(instance_id, None)

    # admin views

    def instances(self) -> list[InstanceView]:
        return [self._instance_view(instance_id) for instance_id in self._sorted_ids]

    def instance(self, instance_id: InstanceId) -> InstanceView:
        return self._instance_view(instance_id)

    def totals(self) -> ClusterTotals:
        views = self.instances()
        serving = [v for v in views if v.state is InstanceState.SERVING]
        return ClusterTotals(
            num_instances=len(views), num_serving=len(serving),
            num_draining=sum(v.state is InstanceState.DRAINING for v in views),
            num_unhealthy=sum(v.state is InstanceState.UNHEALTHY for v in views),
            # a migration in flight counted once, on its source (the destination's load holds it too)
            num_running=sum(v.load.num_running for v in views) - len(migrations_within(views)),
            num_waiting=sum(v.load.num_waiting for v in views),
            average_freeness=pooled_freeness(serving) if serving else 0.0,  # what scaling keeps in its band
            num_dispatched=sum(self._num_dispatched.values()) + self._num_dispatched_to_departed,
        )

    def _instance_view(self, instance_id: InstanceId) -> InstanceView:
        has_report = instance_id in self._reports
        return InstanceView(
            record=self._records[instance_id], state=self.state_of(instance_id), load=self.load_of(instance_id),
            num_dispatched=self._num_dispatched.get(instance_id, 0),
            report_age_s=self._clock() - self._heard_at[instance_id] if has_report else None,
            is_heard=not self._is_unhealthy(instance_id, self._clock() - self._report_timeout_s),
            num_migrations=self._migrating.get(instance_id, 0),
            reported_load=self.reported_load_of(instance_id),
            migrating_in_from=self._incoming.held_from(instance_id),
        )

    def _is_draining(self, instance_id: InstanceId) -> bool:
        return instance_id in self._drained or self._records[instance_id].is_draining

    def _rebuild_eligible(self) -> None:
        self._eligible_ids = [i for i in self._sorted_ids if not self._is_draining(i)]
