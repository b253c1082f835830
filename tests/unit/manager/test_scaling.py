import copy
import dataclasses

import pytest
from etcd3aio.errors import EtcdConnectionError
from structlog.testing import capture_logs

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.scaling_target import ScalingTarget
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceId, InstanceState, Role
from services.manager.leadership import Leadership
from services.manager.scaling import RETIRED_GONE_S, SILENT_RETIREMENT_S, UNFOLLOWED_RETIREMENT_S, ScalingAction, Scaler, ScalingSettings, decide
from tests.unit.manager.factories import FakeClock, make_load, make_record, make_view

pytestmark = pytest.mark.timeout(10)

BAND = ScalingSettings(is_enabled=True, low_freeness=10.0, high_freeness=100.0, min_instances=1, max_instances=3)


def leader() -> Leadership:
    leadership = Leadership("m-1", "addr")
    leadership.set_elected(True)
    return leadership


class FakeStore:
    manager_id = "m-1"

    def __init__(self, target: ScalingTarget | None = None) -> None:
        self.target = target
        self.drained: set[str] = set()
        self.forgotten: list[str] = []  # retired instances whose marks went
        self.num_writes = 0

    async def get_scaling_target(self):
        return copy.deepcopy(self.target)

    async def put_scaling_target(self, target: ScalingTarget) -> None:
        self.target = copy.deepcopy(target)  # what etcd holds: a copy
        self.num_writes += 1

    async def put_drain(self, instance_id) -> None:
        self.drained.add(instance_id)

    async def delete_drain(self, instance_id) -> bool:
        self.drained.discard(instance_id)
        return True

    async def forget_retired(self, instance_id) -> None:
        self.drained.discard(instance_id)
        self.forgotten.append(instance_id)


def busy_view(*instance_ids: str, clock: FakeClock, free: int):
    """Every instance with 9 running requests and `free` free blocks: freeness free / 10."""
    return make_view(*instance_ids, clock=clock, num_free_blocks=free, num_running=9)


def test_decides_inside_the_band_and_its_limits() -> None:
    clock = FakeClock()
    views = busy_view("i-0", "i-1", clock=clock, free=50).instances()  # freeness 5: below the band
    assert decide(views, BAND).action is ScalingAction.ADD
    assert decide(views, dataclasses.replace(BAND, max_instances=2)) is None  # at max_instances
    assert decide(busy_view("i-0", "i-1", clock=clock, free=500).instances(), BAND) is None  # 50: inside
    quiet = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000).instances()  # 1000: above
    retire = decide(quiet, BAND)
    assert retire.action is ScalingAction.RETIRE and retire.instance_id == "i-2"  # newest of the idle ones
    assert decide(quiet[:1], BAND) is None  # at min_instances
    assert decide(views, ScalingSettings()) is None  # off by default


def test_a_just_added_empty_instance_beside_a_backed_up_one_is_not_retired() -> None:
    """The mean of their freeness, (-30 + 1456) / 2 = 713, is above the band and would retire the new one;
    pooled, the cluster is short of blocks: it needs another instance, not one less."""
    clock = FakeClock()
    view = make_view("i-0", clock=clock, num_free_blocks=0, num_running=64, num_waiting=40,
                     num_blocks_needed_by_waiting=1960)
    view.put_member(make_record("i-1"))
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=1456))
    decision = decide(view.instances(), BAND)
    assert decision is not None and decision.action is ScalingAction.ADD and decision.average_freeness < 0


def test_holds_back_while_an_instance_drains_is_unhealthy_or_has_a_role() -> None:
    clock = FakeClock()
    view = busy_view("i-0", "i-1", clock=clock, free=50)
    view.mark_drained(InstanceId("i-1"))
    assert decide(view.instances(), BAND) is None
    view = busy_view("i-0", clock=clock, free=50)
    view.put_member(make_record("i-1"))  # registered, never reported
    assert decide(view.instances(), BAND) is None
    view = busy_view("i-0", clock=clock, free=50)
    view.put_member(make_record("p-0", role=Role.PREFILL))
    view.apply_report(InstanceId("p-0"), make_load(num_free_blocks=50, num_running=9))
    assert decide(view.instances(), BAND) is None


def test_settings_that_make_no_sense_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument, match="scaling_low_freeness"):
        ScalingSettings(low_freeness=10, high_freeness=10).check()
    with pytest.raises(InvalidArgument, match="scaling_min_instances"):
        ScalingSettings(min_instances=3, max_instances=2).check()
    with pytest.raises(InvalidArgument, match=r"^scaling_max_instances must be in \[1, 4096\], got 0"):
        ScalingSettings(min_instances=1, max_instances=0).check()
    with pytest.raises(InvalidArgument, match=r"^scaling_min_instances must be in \[1, 4096\], got 0"):
        ScalingSettings(min_instances=0, max_instances=2).check()
    with pytest.raises(InvalidArgument, match="scaling_high_freeness"):
        ScalingSettings(high_freeness=float("nan")).check()
    with pytest.raises(InvalidArgument, match=r"^scaling_max_instances must be in \[1, 4096\], got 100000"):
        ScalingSettings(max_instances=100000).check()


async def test_adds_once_then_waits_for_the_instance_and_the_cooldown() -> None:
    clock = FakeClock()
    view = busy_view("i-0", clock=clock, free=50)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=30, clock=clock)
    assert (await scaler.tick()).action is ScalingAction.ADD
    assert store.target.num_instances == 2 and store.target.draining == []
    clock.advance(60)
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=50, num_running=9))
    assert await scaler.tick() is None  # past the cooldown, but the new instance has not registered yet
    view.put_member(make_record("i-1"))
    for instance_id in ("i-0", "i-1"):
        view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=50, num_running=9))
    assert (await scaler.tick()).action is ScalingAction.ADD  # both still below the band
    assert store.target.num_instances == 3


async def test_retires_by_draining_then_marks_stoppable_then_forgets_the_drain_mark() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    decision = await scaler.tick()
    assert decision.action is ScalingAction.RETIRE and decision.instance_id == "i-1"
    assert store.drained == {"i-1"} and store.target.draining == ["i-1"] and store.target.num_instances == 1
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=1000))  # empty: is_drained
    assert await scaler.tick() is None
    assert store.target.draining == [] and store.target.stoppable == ["i-1"]
    num_writes = store.num_writes
    assert await scaler.tick() is None and store.num_writes == num_writes  # nothing changed, nothing written
    view.remove_member(InstanceId("i-1"))  # the launcher stopped it
    assert await scaler.tick() is None
    assert store.drained == {"i-1"} and store.forgotten == []  # not yet: a lease blip is no departure
    clock.advance(RETIRED_GONE_S)
    assert await scaler.tick() is None
    assert store.drained == set() and store.target.stoppable == []
    assert store.forgotten == ["i-1"]  # its role mark too: a later instance under its id takes its own --role


async def test_a_burst_during_a_retirement_calls_it_off_and_the_instance_serves_again() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=30, clock=clock)
    assert (await scaler.tick()).action is ScalingAction.RETIRE  # i-1 drains
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=990, num_running=1))  # still has a request
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=900, num_running=49))  # freeness 18: inside
    assert await scaler.tick() is None and store.target.draining == ["i-1"]  # the retirement goes on
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=50, num_running=9))  # the burst: freeness 5
    assert await scaler.tick() is None
    assert store.target.draining == [] and store.target.stoppable == [] and store.target.num_instances == 2
    assert "called off" in store.target.reason
    assert store.drained == set() and view.state_of(InstanceId("i-1")) is InstanceState.SERVING  # takes requests again
    assert await scaler.tick() is None  # the cooldown holds back the ADD the band still asks for
    clock.advance(31)
    for instance_id in ("i-0", "i-1"):
        view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=50, num_running=9))
    assert (await scaler.tick()).action is ScalingAction.ADD


async def test_a_draining_instance_gone_silent_becomes_stoppable_instead_of_holding_scaling() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-1"
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=990, num_running=1))  # a step hangs from here
    hung_at = clock.now
    for _ in range(int(SILENT_RETIREMENT_S) // 10 + 1):
        clock.advance(10)
        view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=1000))
        assert await scaler.tick() is None
        if store.target.stoppable:
            break
        assert store.target.draining == ["i-1"]  # still waited on while silent for less than the bound
    assert store.target.stoppable == ["i-1"] and clock.now - hung_at > SILENT_RETIREMENT_S


async def test_caches_no_larger_than_the_band_are_said_once_to_keep_every_instance() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=200, num_total_blocks=200)  # idle: freeness 200
    settings = dataclasses.replace(BAND, high_freeness=256.0)
    scaler = Scaler(view, leader(), FakeStore(), settings, interval_s=1, cooldown_s=0, clock=clock)
    with capture_logs() as logs:
        assert await scaler.tick() is None and await scaler.tick() is None
        scaler.set_settings(dataclasses.replace(settings, high_freeness=150.0))
        assert (await scaler.tick()).action is ScalingAction.RETIRE
    assert [entry["num_total_blocks"] for entry in logs if entry["event"] == "scaling_never_retires"] == [200]


async def test_a_drained_instance_already_stoppable_is_not_called_back() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=30, clock=clock)
    await scaler.tick()
    assert await scaler.tick() is None and store.target.stoppable == ["i-1"]  # empty: the launcher may stop it
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=50, num_running=9))
    assert await scaler.tick() is None
    assert store.target.stoppable == ["i-1"] and store.target.num_instances == 1 and store.drained == {"i-1"}


async def three_idle_retiring_i2() -> tuple[FakeClock, ClusterView, FakeStore, Scaler]:
    """Three idle instances; the first tick retires i-2 (it starts draining)."""
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"
    return clock, view, store, scaler


async def test_undrain_calls_off_a_retirement_still_draining_but_not_a_stoppable_one() -> None:
    clock, view, store, scaler = await three_idle_retiring_i2()
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=990, num_running=1))  # still draining
    await scaler.call_off(InstanceId("i-2"))
    assert (store.target.num_instances, store.target.draining, store.drained) == (3, [], set())
    assert "called off by Undrain" in store.target.reason
    await scaler.call_off(InstanceId("i-0"))  # not retiring: nothing to call off
    assert store.target.num_instances == 3
    clock.advance(1)
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=1000))  # its request finished
    assert (await scaler.tick()).instance_id == "i-2"  # idle again: retired again
    await scaler.tick()  # empty: stoppable
    with pytest.raises(FailedPrecondition, match="may be stopping now"):
        await scaler.call_off(InstanceId("i-2"))


async def test_undrain_keeps_a_stoppable_instance_no_launcher_stopped_in_time() -> None:
    """Scaling turned on by a policy alone retires an instance nothing stops: it must not stay drained for good."""
    clock, _, store, scaler = await three_idle_retiring_i2()
    await scaler.tick()  # empty: stoppable
    assert store.target.stoppable == ["i-2"]
    clock.advance(UNFOLLOWED_RETIREMENT_S - 1)
    with pytest.raises(FailedPrecondition, match="Undrain works 1 s from now"):
        await scaler.call_off(InstanceId("i-2"))
    clock.advance(1)
    await scaler.call_off(InstanceId("i-2"))
    assert (store.target.num_instances, store.target.stoppable, store.drained) == (3, [], set())
    assert "no launcher stopped it" in store.target.reason


async def test_a_new_leader_follows_the_retirement_its_predecessor_started() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    view.mark_drained(InstanceId("i-1"))
    store = FakeStore(ScalingTarget(1, draining=["i-1"], reason="earlier", manager_id="m-0"))
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert await scaler.tick() is None
    assert store.target.stoppable == ["i-1"]


async def test_a_leader_that_was_standby_meanwhile_reads_the_target_again() -> None:
    clock = FakeClock()
    view = make_view("i-0", "i-1", clock=clock, num_free_blocks=1000)
    leadership = leader()
    store = FakeStore(ScalingTarget(2, manager_id="m-0"))
    off = ScalingSettings()  # scaling off: nothing new is decided, retirements under way are still followed
    scaler = Scaler(view, leadership, store, off, interval_s=1, cooldown_s=0, clock=clock)
    assert await scaler.tick() is None
    leadership.set_elected(False)
    assert await scaler.tick() is None
    view.mark_drained(InstanceId("i-1"))
    store.target = ScalingTarget(1, draining=["i-1"], reason="the other leader", manager_id="m-0")
    leadership.set_elected(True)
    assert await scaler.tick() is None
    assert store.target.stoppable == ["i-1"]  # drained (empty report): it took over the other's retirement


class UnreachableStore(FakeStore):
    """etcd down: every read fails as the etcd client's does."""

    async def get_scaling_target(self):
        raise EtcdConnectionError("KV.Range failed after 3 attempts: UNAVAILABLE (Connection refused)")


async def test_a_leader_whose_etcd_is_away_skips_its_tick_with_a_warning() -> None:
    # Found by a chaos run killing etcd: the first tick of a term that found etcd away logged a traceback
    # (periodic_step_failed) every interval as if scaling had a bug.
    clock = FakeClock()
    scaler = Scaler(make_view("i-0", "i-1", clock=clock, num_free_blocks=1000), leader(), UnreachableStore(), BAND,
                    interval_s=1, cooldown_s=0, clock=clock)
    with capture_logs() as logs:
        assert await scaler.tick() is None
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == ["scaling_tick_skipped"]


async def test_a_standby_does_nothing() -> None:
    clock = FakeClock()
    leadership = Leadership("m-2", "addr")
    leadership.set_elected(False)
    store = FakeStore()
    scaler = Scaler(busy_view("i-0", clock=clock, free=50), leadership, store, BAND, 1, 0, clock=clock)
    assert await scaler.tick() is None and store.target is None


async def test_a_stoppable_instance_whose_drain_mark_went_is_called_off():
    # An Undrain answered by a standby (whose leader did not answer in time) deletes the mark and
    # nothing more: the instance serves again but stayed listed stoppable, scaling frozen (found by review).
    clock = FakeClock()
    view = make_view("i-0", "i-1", "i-2", clock=clock, num_free_blocks=1000)
    store = FakeStore()
    scaler = Scaler(view, leader(), store, BAND, interval_s=1, cooldown_s=0, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"
    clock.advance(1)
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=1000))
    await scaler.tick()
    assert store.target.stoppable == ["i-2"]
    clock.advance(30)
    await store.delete_drain(InstanceId("i-2"))
    view.unmark_drained(InstanceId("i-2"))
    for _ in range(3):
        clock.advance(10)
        for instance_id in ("i-0", "i-1", "i-2"):
            view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=1000))
        await scaler.tick()
    assert "i-2" not in store.target.stoppable


def test_cluster_status_shows_the_freeness_scaling_compares_to_its_band():
    # It showed the mean of the instances' freeness: 713 beside a backed-up instance while the leader
    # added one at -7.6 (found by review).
    clock = FakeClock()
    view = make_view("i-0", clock=clock, num_free_blocks=0, num_running=64, num_waiting=40,
                     num_blocks_needed_by_waiting=1960)
    view.put_member(make_record("i-1"))
    view.apply_report(InstanceId("i-1"), make_load(num_free_blocks=1456))
    decision = decide(view.instances(), ScalingSettings(is_enabled=True, low_freeness=10, high_freeness=500,
                                                        max_instances=5))
    assert decision.action is ScalingAction.ADD
    assert view.totals().average_freeness == pytest.approx(decision.average_freeness)


async def test_an_add_waited_on_in_an_earlier_term_does_not_hold_the_next_one() -> None:
    # The instance asked for never came (another leader's term in between may have changed the target);
    # before, a leader that led again waited out the add's 300 s timeout (found by review).
    clock = FakeClock()
    view = busy_view("i-0", clock=clock, free=50)
    store = FakeStore()
    leadership = leader()
    scaler = Scaler(view, leadership, store, BAND, interval_s=1, cooldown_s=30, clock=clock)
    assert (await scaler.tick()).action is ScalingAction.ADD
    leadership.set_elected(False)
    assert await scaler.tick() is None
    store.target.num_instances = 1  # the other leader's term: the add was dropped
    store.target.updated_at = 0.0
    leadership.set_elected(True)
    clock.advance(60)
    view.apply_report(InstanceId("i-0"), make_load(num_free_blocks=50, num_running=9))
    assert (await scaler.tick()).action is ScalingAction.ADD


async def test_a_max_lowered_below_the_count_retires_one_at_a_time_whatever_the_band() -> None:
    """An operator lowered scaling_max_instances under load (ferryctl policy set --set scaling_max_instances=1
    with 2 instances busy): nothing happened while the band did not ask for a retirement (black-box run)."""
    clock = FakeClock()
    view = busy_view("i-0", "i-1", "i-2", clock=clock, free=50)  # freeness 5: below the band, a burst
    lowered = dataclasses.replace(BAND, max_instances=1)
    retire = decide(view.instances(), lowered)
    assert retire.action is ScalingAction.RETIRE and retire.instance_id == "i-2"
    assert retire.reason == "3 instances is above scaling_max_instances (1)"
    store = FakeStore()
    scaler = Scaler(view, leader(), store, lowered, interval_s=1, cooldown_s=30, clock=clock)
    assert (await scaler.tick()).instance_id == "i-2"
    assert store.target.num_instances == 2 and store.target.draining == ["i-2"]
    view.apply_report(InstanceId("i-2"), make_load(num_free_blocks=50, num_running=9))  # still has requests
    assert await scaler.tick() is None
    assert store.target.draining == ["i-2"]  # the burst does not call it off: that would go over the bound
    view.remove_member(InstanceId("i-2"))  # the launcher stopped it
    assert await scaler.tick() is None  # the cooldown
    clock.advance(31)
    for instance_id in ("i-0", "i-1"):
        view.apply_report(InstanceId(instance_id), make_load(num_free_blocks=50, num_running=9))
    assert (await scaler.tick()).instance_id == "i-1"  # the next one, down to the bound
    assert decide(busy_view("i-0", "i-1", clock=clock, free=50).instances(), BAND).action is ScalingAction.ADD
