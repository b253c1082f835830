"""The migration loop's pacing (migrator.py): which instances sit a tick out, which pairs back off, which requests
cool down, and how fast the loop ticks while owed moves (drains, PD hand-offs) run.

A migration holds a slot on both of its instances until MigrateOut returns (at most `max_per_instance` at once on
one instance); then both sit out until their next load report (an older one still shows the request where it
was). A pair whose migration did not commit waits `failure_backoff_s`; a request that committed is left alone for
`cooldown_s`. What is kept per instance or pair goes once it left (`forget_departed`). No transport; the clock is
the cluster view's (report ages are measured with it).
"""

from __future__ import annotations

from collections.abc import Callable

from services.manager.domain import InstanceId
from services.manager.migration import MigrationOrder

Clock = Callable[[], float]


class MigrationPacing:
    def __init__(self, max_per_instance: int, cooldown_s: float, failure_backoff_s: float, clock: Clock) -> None:
        self._max_per_instance = max_per_instance
        self._cooldown_s = cooldown_s
        self._failure_backoff_s = failure_backoff_s
        self._clock = clock
        self._in_flight: dict[InstanceId, int] = {}  # invariant: MigrateOut calls running per instance, > 0
        self._ended_at: dict[InstanceId, float] = {}  # its last migration ended then; sits out until a newer report
        self._received_at: dict[InstanceId, float] = {}  # a migration to it last ended then (ties go to others)
        self._cooled: dict[str, float] = {}  # request id -> when it committed somewhere
        self._failed_at: dict[tuple[InstanceId, InstanceId], float] = {}  # (src, dst) -> its last failure
        self._num_owed_in_flight = 0  # drain and PD migrations started and not ended
        self._owed_ended_at = float("-inf")  # when the last of them ended

    # instances

    def is_at_limit(self, instance_id: InstanceId) -> bool:
        return self._in_flight.get(instance_id, 0) >= self._max_per_instance

    def is_busy(self, instance_id: InstanceId) -> bool:
        """A migration of ours runs on it now."""
        return bool(self._in_flight.get(instance_id))

    def is_waiting_for_report(self, instance_id: InstanceId, reported_at: float) -> bool:
        """Its last migration ended after its last report (made at `reported_at`): that report shows too little."""
        return reported_at <= self._ended_at.get(instance_id, float("-inf"))

    def last_received_at(self, instance_id: InstanceId) -> float:
        return self._received_at.get(instance_id, float("-inf"))

    def hold(self, order: MigrationOrder) -> None:
        for instance_id in (order.src_instance_id, order.dst_instance_id):
            self._in_flight[instance_id] = self._in_flight.get(instance_id, 0) + 1

    def release(self, order: MigrationOrder, has_run: bool) -> None:
        """Both sit out until their next report; only the source where it refused at once (`has_run` False:
        its next report shows its migration slots; the destination saw nothing)."""
        now = self._clock()
        for instance_id in (order.src_instance_id, order.dst_instance_id):
            self._in_flight[instance_id] -= 1
            if not self._in_flight[instance_id]:
                del self._in_flight[instance_id]
        self._ended_at[order.src_instance_id] = now
        if has_run:
            self._ended_at[order.dst_instance_id] = now
            self._received_at[order.dst_instance_id] = now

    # pairs and requests

    def note_failed(self, src_id: InstanceId, dst_id: InstanceId) -> None:
        self._failed_at[src_id, dst_id] = self._clock()

    def is_not_backing_off(self, src_id: InstanceId, dst_id: InstanceId) -> bool:
        key = (src_id, dst_id)
        failed_at = self._failed_at.get(key)
        if failed_at is None:
            return True
        if self._clock() - failed_at >= self._failure_backoff_s:
            del self._failed_at[key]
            return True
        return False

    def note_committed(self, request_id: str) -> None:
        self._cooled[request_id] = self._clock()

    def cooled_request_ids(self) -> frozenset[str]:
        """Requests that committed within `cooldown_s` (the others are forgotten here)."""
        horizon = self._clock() - self._cooldown_s
        self._cooled = {r: t for r, t in self._cooled.items() if t > horizon}
        return frozenset(self._cooled)

    def forget_departed(self, is_member: Callable[[str], bool]) -> None:
        """Drop what is kept per instance once it has left (ids of restarted instances can be new each time),
        and the failures of pairs whose backoff is over (else one per pair of members could stay)."""
        for per_instance in (self._ended_at, self._received_at):
            for instance_id in [i for i in per_instance if not is_member(i)]:
                del per_instance[instance_id]
        backed_off_since = self._clock() - self._failure_backoff_s
        for pair in [p for p, failed_at in self._failed_at.items()
                     if failed_at <= backed_off_since or not (is_member(p[0]) and is_member(p[1]))]:
            del self._failed_at[pair]

    # the loop's pace

    def begin_owed(self) -> None:
        """A drain or PD migration started (counted from its start, so the tick that started it sees it)."""
        self._num_owed_in_flight += 1

    def end_owed(self) -> None:
        self._num_owed_in_flight -= 1
        self._owed_ended_at = self._clock()

    def is_moving_owed(self, settle_s: float) -> bool:
        """Owed migrations run, or the last ended within `settle_s` (the pair's fresh reports may start the next)."""
        return self._num_owed_in_flight > 0 or self._clock() - self._owed_ended_at < settle_s
