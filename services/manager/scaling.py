"""Scaling decisions: keep the cluster's average freeness inside a band.

Every tick the leader looks at the serving instances. When their average freeness
(free KV blocks per running request, less what queued requests need, pooled over the
instances as if they were one: `pooled_freeness`) falls below
`low_freeness`, it asks for one more instance; above `high_freeness` it retires one:
drains it (its requests migrate away) and, once nothing runs there, says it may be
stopped. It decides; a launcher acts. The decision is written to etcd
`/ferry/<cluster>/scaling/target` (services/common/scaling_target.py), which
`python -m services.cluster up` follows with local processes and
`python -m services.cluster.scale_hooks` with commands (systemctl).

One action at a time: nothing happens while an instance drains, is unhealthy, or an
added one has not registered yet, nor within `cooldown_s` of the last action. A draining
instance silent for SILENT_RETIREMENT_S counts as drained (its streams were resumed elsewhere). The one
exception is a burst during a retirement: if the other instances' average freeness falls
below the band while one still drains, the retirement is called off (its drain mark goes,
the target grows back) and the instance serves again at once, rather than being stopped
and an instance started cold after it. Only
clusters of `both` instances scale: with prefill/decode roles it holds back (which role
to add is a PD question the band cannot answer). More serving instances than `max_instances`
(the bound lowered by SetPolicy) retires one per action whatever the band says, and a burst
does not call off a retirement that keeps the count within the bound. Retired instances leave the cluster
with their drain mark; the leader deletes its mark once they are gone, so a later
instance with the same id starts serving (an operator's Drain of it stands).
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from services.common.error_text import error_text
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.periodic import periodic_loop
from services.common.scaling_target import ScalingTarget
from services.manager import metrics
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceId, InstanceState, InstanceView, Role, pooled_freeness
from services.manager.leadership import Leadership

log = structlog.get_logger(__name__)

ADD_TIMEOUT_S = 300.0  # an asked-for instance that has not registered by then is asked for again
# A stoppable instance still there after this long is one no launcher follows: Undrain may keep it.
UNFOLLOWED_RETIREMENT_S = 10.0
# A retiring instance absent from the membership this long is gone (stopped): its marks go. Not one whose lease
# blipped (expired, and it registered again at once): its retirement carries on.
RETIRED_GONE_S = 10.0
MARKLESS_S = 15.0  # a retiring instance without a drain mark this long serves again (its mark went another way;
#   longer than the settings watch takes to come back after an etcd outage, up to its 5 s backoff)
# A draining instance that sends no load report this long (a hung step: its stall watchdog ended its streams,
# and the frontends resumed them elsewhere) is stoppable: stopping it loses nothing, waiting would hold scaling.
SILENT_RETIREMENT_S = 60.0


MAX_SCALED_INSTANCES = 4096  # the most instances scaling may ask for (the tables keyed by peer hold that many)


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    """The scaling part of the cluster policy (stored with it in etcd config/policy)."""

    is_enabled: bool = False
    low_freeness: float = 4.0  # below this average freeness: add an instance
    high_freeness: float = 256.0  # above it: retire one
    min_instances: int = 1
    max_instances: int = 4

    def check(self) -> None:
        """InvalidArgument naming the field when the band or the bounds make no sense."""
        for name in ("low_freeness", "high_freeness"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"scaling_{name} must be a finite number, got {getattr(self, name)}")
        if self.low_freeness >= self.high_freeness:
            raise InvalidArgument(f"scaling_low_freeness ({self.low_freeness}) must be below scaling_high_freeness "
                                  f"({self.high_freeness}), or every tick would both add and retire")
        for name in ("min_instances", "max_instances"):
            if not 1 <= getattr(self, name) <= MAX_SCALED_INSTANCES:
                raise InvalidArgument(f"scaling_{name} must be in [1, {MAX_SCALED_INSTANCES}], got {getattr(self, name)}")
        if self.min_instances > self.max_instances:
            raise InvalidArgument(f"scaling_min_instances ({self.min_instances}) must be <= "
                                  f"scaling_max_instances ({self.max_instances})")


class ScalingAction(enum.Enum):
    ADD = "add"
    RETIRE = "retire"


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    action: ScalingAction
    num_instances: int  # serving instances now
    average_freeness: float
    instance_id: InstanceId | None = None  # RETIRE: the instance to drain and stop
    max_instances: int | None = None  # RETIRE because the count is above this scaling_max_instances, not the band

    @property
    def reason(self) -> str:
        if self.max_instances is not None:
            return f"{self.num_instances} instances is above scaling_max_instances ({self.max_instances})"
        side = "below" if self.action is ScalingAction.ADD else "above"
        return f"average freeness {self.average_freeness:.1f} over {self.num_instances} instances is {side} the band"


def decide(views: Sequence[InstanceView], settings: ScalingSettings) -> ScalingDecision | None:
    """What to do now, if anything (see the module docstring for when it holds back)."""
    if not settings.is_enabled or not views:
        return None
    if any(v.record.role is not Role.BOTH or v.state is not InstanceState.SERVING or v.report_age_s is None
           for v in views):
        return None
    average = pooled_freeness(views)
    if len(views) > settings.max_instances:  # the bound was lowered below the count: retire, whatever the band says
        return ScalingDecision(ScalingAction.RETIRE, len(views), average, _idlest(views), settings.max_instances)
    if average < settings.low_freeness and len(views) < settings.max_instances:
        return ScalingDecision(ScalingAction.ADD, len(views), average)
    if average > settings.high_freeness and len(views) > settings.min_instances:
        return ScalingDecision(ScalingAction.RETIRE, len(views), average, _idlest(views))
    return None


def _idlest(views: Sequence[InstanceView]) -> InstanceId:
    """The instance with the fewest requests, the newest among equals."""
    idlest = min(views, key=lambda v: (v.load.num_running + v.load.num_waiting, _newest_first(v.record.instance_id)))
    return idlest.record.instance_id


def _newest_first(instance_id: str) -> tuple[int, str]:
    """Sort key that puts the highest numbered id (instance-10 after instance-9) first."""
    digits = "".join(c for c in instance_id if c.isdigit())
    return (-int(digits) if digits else 0, "".join(reversed(instance_id)))


class ScalingStore(Protocol):
    manager_id: str

    async def get_scaling_target(self) -> ScalingTarget | None: ...
    async def put_scaling_target(self, target: ScalingTarget) -> None: ...
    async def put_drain(self, instance_id: InstanceId) -> None: ...
    async def delete_drain(self, instance_id: InstanceId) -> bool: ...  # False: an operator's mark, kept
    async def forget_retired(self, instance_id: InstanceId) -> None: ...  # its role mark, and its drain mark unless an operator's


@dataclass(slots=True)
class _Lasting:
    """Instances seen in some state at every look since a time: those in it for `bound_s` or more."""

    bound_s: float
    since: dict[InstanceId, float] = field(default_factory=dict)

    def lasting(self, instance_ids: list[InstanceId], now: float) -> list[InstanceId]:
        """`instance_ids` are in the state now (the others left it: forgotten); those in it since `bound_s`."""
        self.since = {i: self.since.get(i, now) for i in instance_ids}
        return [i for i, since in self.since.items() if now - since >= self.bound_s]


class Scaler:
    def __init__(self, view: ClusterView, leadership: Leadership, store: ScalingStore, settings: ScalingSettings,
                 interval_s: float, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._view = view
        self._leadership = leadership
        self._store = store
        self.settings = settings
        self._interval_s = interval_s
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._last_action_at = -math.inf
        self._adding: tuple[int, float] | None = None  # (members expected, give up at) after an ADD
        self._target: ScalingTarget | None = None  # what we last wrote, while instances retire
        # The leadership term whose target we read (on becoming leader, pick up the retirements a predecessor
        # started): a new term, even one begun inside a tick, reads it again before acting or writing.
        self._read_in_term: int | None = None
        self._reading_target = asyncio.Lock()
        self._stoppable_since: dict[InstanceId, float] = {}  # when we saw each retiring instance drained
        self._writing = asyncio.Lock()  # target writes one at a time: the last one sent is the last one to land
        self._is_unwritten = False  # the last target's write failed: written again on the next tick
        self._markless = _Lasting(MARKLESS_S)  # retiring instances seen without a drain mark
        self._silent = _Lasting(SILENT_RETIREMENT_S)  # draining instances seen without a recent report
        self._gone = _Lasting(RETIRED_GONE_S)  # retiring instances seen absent from the membership
        self._never_retiring_warned: tuple[ScalingSettings, int] | None = None

    def set_settings(self, settings: ScalingSettings) -> None:
        self.settings = settings

    async def scaling_loop(self) -> None:
        await periodic_loop("scaling", self._interval_s, self.tick)

    async def tick(self) -> ScalingDecision | None:
        """One look at the band. etcd unreachable (an outage, a restart), or a write refused because this
        manager was deposed while it waited on etcd (the store's fence), skips the tick with a warning,
        not the loop's traceback: the next tick reads (and writes) again, or sees it does not lead."""
        try:
            return await self._tick()
        except ETCD_ERRORS as exc:
            log.warning("scaling_tick_skipped", reason="etcd_unreachable", error=error_text(exc))
        except Unavailable as exc:
            log.warning("scaling_tick_skipped", reason="leadership_lost", error=exc.message)
        return None

    async def _tick(self) -> ScalingDecision | None:
        if not self._leadership.is_leader:
            return None
        await self._read_target_once()
        if self._is_unwritten and self._target is not None:
            await self._write(self._target)
        views = self._view.instances()
        self._warn_if_never_retiring(views)
        if await self._follow_retirements(views) or self._is_waiting(views):
            return None
        decision = decide(views, self.settings)
        if decision is not None:
            await self._act(decision)
        return decision

    async def _read_target_once(self) -> None:
        """On becoming leader, before this term acts on a target: the one in etcd, not one kept from an earlier
        term (another leader may have written its own since)."""
        async with self._reading_target:  # a tick and an Undrain at once: one read, one target object
            term = self._leadership.term
            if self._read_in_term != term:
                self._adding = None  # another leader may have acted meanwhile (its cooldown stands for our add)
                # "Seen since" counts only looks in a row: a new term's first look finds no instance reported yet.
                self._markless, self._silent = _Lasting(MARKLESS_S), _Lasting(SILENT_RETIREMENT_S)
                self._gone = _Lasting(RETIRED_GONE_S)
                self._adopt(await self._store.get_scaling_target())
                self._read_in_term = term

    def _check_term(self) -> None:
        """Before each etcd write: Unavailable if a new term began after this one read the target (deposed and
        elected again while a tick waited on etcd; the fence checks only the current epoch). The next tick reads
        the target again."""
        if self._leadership.term != self._read_in_term:
            raise Unavailable("scaling write not made: this manager was deposed and elected again while it waited "
                              "on etcd; the next tick reads the stored target again")

    def _warn_if_never_retiring(self, views: list[InstanceView]) -> None:
        """An idle instance's freeness is its whole cache in blocks: with caches no larger than `high_freeness`,
        the band can never retire one. Said once per (settings, largest cache)."""
        largest = max((v.load.num_total_blocks for v in views), default=0)
        if not self.settings.is_enabled or not largest or largest > self.settings.high_freeness:
            return
        if self._never_retiring_warned != (self.settings, largest):
            self._never_retiring_warned = (self.settings, largest)
            log.warning("scaling_never_retires", num_total_blocks=largest, high_freeness=self.settings.high_freeness,
                        action="an idle instance's freeness is its cache in blocks: lower scaling_high_freeness below it "
                               "(ferryctl policy set --set scaling_high_freeness=N), or give instances more KV cache")

    def _adopt(self, target: ScalingTarget | None) -> None:
        """On becoming leader: the retirements a predecessor started, and the cooldown of its last write
        (so an instance it just asked for is not asked for twice)."""
        self._target = target
        stoppable = target.stoppable if target is not None else []  # when we saw others stoppable: of no use now
        self._stoppable_since = {i: t for i, t in self._stoppable_since.items() if i in stoppable}
        if target is not None and target.updated_at:
            self._last_action_at = self._clock() - max(0.0, time.time() - target.updated_at)

    def _is_waiting(self, views: list[InstanceView]) -> bool:
        now = self._clock()
        if self._adding is not None:
            num_expected, give_up_at = self._adding
            if len(views) < num_expected and now < give_up_at:
                return True
            self._adding = None
        return now - self._last_action_at < self._cooldown_s

    async def _follow_retirements(self, views: list[InstanceView]) -> bool:
        """Move drained instances to `stoppable`, forget those gone; True while any is still retiring."""
        target = self._target
        if target is None or not (target.draining or target.stoppable):
            return False
        present = {v.record.instance_id: v for v in views}
        before = (list(target.draining), list(target.stoppable))
        absent = [i for i in target.stoppable + target.draining if i not in present]
        for instance_id in self._gone.lasting(absent, self._clock()):
            self._check_term()
            await self._store.forget_retired(instance_id)  # gone: a later instance with its id serves, own role
            self._stop_retiring(target, instance_id)
            log.info("scaling_instance_retired", instance_id=instance_id)
        if target.draining and (average := self._others_short_of_band(views, target)) is not None:
            await self._cancel_draining(target, average)
        for instance_id in self._markless_ones(target):  # its mark went another way (an Undrain a standby answered)
            await self._call_off(target, [instance_id], f"retirement of {instance_id} called off: its drain "
                                                         "mark is gone")
        silent = self._silent_ones(target, present)
        for instance_id in [i for i in target.draining if i in present and (present[i].is_drained or i in silent)]:
            target.draining.remove(instance_id)
            target.stoppable.append(instance_id)
            self._stoppable_since[instance_id] = self._clock()
            log.info("scaling_instance_stoppable", instance_id=instance_id, is_silent=instance_id in silent)
        if (target.draining, target.stoppable) != before:
            await self._write(target)
        return bool(target.draining or target.stoppable)

    def _markless_ones(self, target: ScalingTarget) -> list[InstanceId]:
        """Retiring instances whose drain mark the view has not shown for MARKLESS_S (not one missing only
        for a moment, as in a view still syncing its watch after a failover)."""
        markless = [i for i in target.draining + target.stoppable if not self._view.has_drain_mark(i)]
        return self._markless.lasting(markless, self._clock())

    def _silent_ones(self, target: ScalingTarget, present: dict[InstanceId, InstanceView]) -> list[InstanceId]:
        """Draining instances that have sent this leader no load report for SILENT_RETIREMENT_S."""
        silent = [i for i in target.draining if i in present and (not present[i].is_heard
                                                                   or present[i].report_age_s is None)]
        return self._silent.lasting(silent, self._clock())

    def _others_short_of_band(self, views: list[InstanceView], target: ScalingTarget) -> float | None:
        """The average freeness of the serving instances that are not retiring, if below the band."""
        retiring = set(target.draining) | set(target.stoppable)
        others = [v for v in views if v.record.instance_id not in retiring and v.state is InstanceState.SERVING
                  and v.report_age_s is not None]
        if not self.settings.is_enabled or not others:
            return None
        if len(others) + len(target.draining) > self.settings.max_instances:  # calling off would go over the bound
            return None
        average = pooled_freeness(others)
        return average if average < self.settings.low_freeness else None

    async def _cancel_draining(self, target: ScalingTarget, average: float) -> None:
        """The burst case: every retirement still draining is called off."""
        await self._call_off(target, list(target.draining), f"retirement called off: average freeness "
                                                              f"{average:.1f} of the others is below the band")

    async def call_off(self, instance_id: InstanceId) -> None:
        """An operator's Undrain: a retirement of `instance_id` still draining is called off (the
        instance stays). Once it is stoppable its launcher may be stopping it: FailedPrecondition,
        unless it has been stoppable for UNFOLLOWED_RETIREMENT_S, longer than any launcher following
        the target takes (every second), so none follows (scaling turned on by a policy alone)."""
        if not self._leadership.is_leader:
            return
        await self._read_target_once()  # an Undrain may come before this term's first tick
        target = self._target
        if target is None:
            return
        if instance_id in target.stoppable:
            stoppable_for_s = self._clock() - self._stoppable_since.setdefault(instance_id, self._clock())
            if stoppable_for_s < UNFOLLOWED_RETIREMENT_S:
                raise FailedPrecondition(
                    f"instance {instance_id} is retired by scaling and may be stopping now; start a new instance "
                    f"instead (if no launcher follows the scaling target, Undrain works "
                    f"{UNFOLLOWED_RETIREMENT_S - stoppable_for_s:.0f} s from now)")
            await self._call_off(target, [instance_id], f"retirement of {instance_id} called off by Undrain "
                                                         f"(no launcher stopped it in {stoppable_for_s:.0f} s)")
            await self._write(target)
        elif instance_id in target.draining:
            await self._call_off(target, [instance_id], f"retirement of {instance_id} called off by Undrain")
            await self._write(target)

    def _stop_retiring(self, target: ScalingTarget, instance_id: InstanceId) -> None:
        """`instance_id` leaves the target's retiring lists (gone, or serving again)."""
        for retiring in (target.draining, target.stoppable):
            if instance_id in retiring:
                retiring.remove(instance_id)
        self._stoppable_since.pop(instance_id, None)

    async def _call_off(self, target: ScalingTarget, instance_ids: list[InstanceId], reason: str) -> None:
        """Those instances serve again: drain marks deleted, back in the target; the cooldown restarts.
        One that another call off gave back while etcd answered this one (an Undrain sent twice, one
        during a burst's call off) is counted once."""
        for instance_id in instance_ids:
            self._check_term()
            if await self._store.delete_drain(instance_id):  # an operator's Drain of it stands
                self._view.unmark_drained(instance_id)
            if instance_id not in target.draining + target.stoppable:
                continue
            self._stop_retiring(target, instance_id)
            target.num_instances += 1
            metrics.SCALING_ACTIONS.labels("cancel_retire").inc()
            log.info("scaling_retirement_cancelled", instance_id=instance_id, reason=reason)
        target.reason = reason
        self._last_action_at = self._clock()

    async def _act(self, decision: ScalingDecision) -> None:
        if decision.action is ScalingAction.ADD:
            target = ScalingTarget(decision.num_instances + 1, reason=decision.reason)
            self._adding = (decision.num_instances + 1, self._clock() + ADD_TIMEOUT_S)
        else:
            assert decision.instance_id is not None
            target = ScalingTarget(decision.num_instances - 1, draining=[decision.instance_id], reason=decision.reason)
            self._target = target  # before any await: followed from here even if a write below fails
            self._check_term()
            await self._store.put_drain(decision.instance_id)
            self._view.mark_drained(decision.instance_id)
        self._target = target
        self._last_action_at = self._clock()
        await self._write(target)
        metrics.SCALING_ACTIONS.labels(decision.action.value).inc()
        log.info("scaling_decided", action=decision.action.value, instance_id=decision.instance_id,
                 num_instances=decision.num_instances, target_instances=target.num_instances,
                 average_freeness=round(decision.average_freeness, 2))

    async def _write(self, target: ScalingTarget) -> None:
        """Put the target in etcd; if that fails it is put again on the next tick (the failure propagates:
        the loop logs it). One write at a time (a tick's and an Undrain's may overlap), so the flag says
        whether the last one landed, not whichever answered last."""
        async with self._writing:
            self._check_term()
            target.manager_id, target.updated_at = self._store.manager_id, time.time()
            self._is_unwritten = True
            await self._store.put_scaling_target(target)
            self._is_unwritten = False
