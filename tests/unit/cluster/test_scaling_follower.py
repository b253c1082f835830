import asyncio
import contextlib
from dataclasses import dataclass

import pytest

from services.cluster import launcher
from services.cluster.scaling_follower import follow_step
from services.cluster.supervisor import RestartPolicy, Supervisor

pytestmark = pytest.mark.timeout(10)


@dataclass
class FakeProcess:
    name: str
    module: str = "instance"
    alive: bool = True
    pid: int = 1
    stopping: bool = False
    coming_back: bool = False  # exited, and the supervisor is about to start it again
    returncode: int | None = None
    any_exit_fails: bool = False

    def is_alive(self) -> bool:
        return self.alive

    def stop(self) -> None:
        self.alive = False


class FakeCluster:
    def __init__(self, *names: str, max_instances: int = 10) -> None:
        self.processes = [FakeProcess("manager-0", module="manager"), *(FakeProcess(n) for n in names)]
        self.added: list[str] = []
        self.num_writes = 0
        self.max_instances = max_instances

    def will_run(self, process: FakeProcess) -> bool:
        return process.alive or process.coming_back

    async def add_instance(self) -> FakeProcess:
        process = FakeProcess(f"instance-{len(self.processes) + len(self.added)}")
        self.added.append(process.name)
        self.processes.append(process)
        return process

    def rewrite_state(self) -> None:
        self.num_writes += 1


class FakeRegistry:
    def __init__(self, target) -> None:
        self.target = target

    async def get_json(self, key: str):
        assert key == "scaling/target"
        return self.target


def target(num_instances: int, manager_id: str = "m-0", draining=(), stoppable=()) -> dict:
    return {"num_instances": num_instances, "draining": list(draining), "stoppable": list(stoppable),
            "manager_id": manager_id, "reason": "test", "updated_at": 1.0}


async def test_starts_instances_up_to_the_target_one_per_step() -> None:
    cluster = FakeCluster("instance-0")
    await follow_step(cluster, FakeRegistry(target(3)))
    await follow_step(cluster, FakeRegistry(target(3)))
    await follow_step(cluster, FakeRegistry(target(3)))
    assert len(cluster.added) == 2 and cluster.num_writes == 2


async def test_stops_the_stoppable_and_keeps_the_draining() -> None:
    cluster = FakeCluster("instance-0", "instance-1", "instance-2")
    await follow_step(cluster, FakeRegistry(target(1, draining=["instance-1"], stoppable=["instance-2"])))
    assert [p.name for p in cluster.processes] == ["manager-0", "instance-0", "instance-1"]
    assert cluster.added == []  # instance-0 serves: the target of 1 is met


async def test_follows_nothing_until_a_leader_decided_and_then_replaces_a_dead_instance() -> None:
    cluster = FakeCluster("instance-0", "instance-1")
    cluster.processes[1].alive = False  # instance-0 crashed
    await follow_step(cluster, FakeRegistry(target(2, manager_id="")))  # the launcher's own startup target
    await follow_step(cluster, FakeRegistry(None))
    assert cluster.added == []
    await follow_step(cluster, FakeRegistry(target(2)))
    assert len(cluster.added) == 1


async def test_an_instance_the_supervisor_restarts_is_not_also_replaced() -> None:
    cluster = FakeCluster("instance-0", "instance-1")
    cluster.processes[2].alive, cluster.processes[2].coming_back = False, True
    await follow_step(cluster, FakeRegistry(target(2)))
    assert cluster.added == []


async def test_never_more_than_max_instances_whatever_the_target() -> None:
    """A policy stored in a kept --state-dir may let the leader want more than --autoscale-max-instances."""
    cluster = FakeCluster("instance-0", max_instances=2)
    for _ in range(4):
        await follow_step(cluster, FakeRegistry(target(3)))
    assert len(cluster.added) == 1


class PolicyRegistry:
    def __init__(self, policy) -> None:
        self.policy, self.writes = policy, 0

    async def get_json(self, key: str):
        assert key == "config/policy"
        return self.policy

    async def put_json(self, key: str, value) -> None:
        self.policy, self.writes = value, self.writes + 1


async def test_a_stored_scaling_band_gets_the_launchers_bounds_and_keeps_the_rest() -> None:
    from services.cluster.scaling_follower import align_stored_scaling
    stored = {"dispatch": "load", "scaling": {"enabled": False, "low_freeness": 5.0, "high_freeness": 50.0,
                                              "min_instances": 1, "max_instances": 5}}
    registry = PolicyRegistry(stored)
    await align_stored_scaling(registry, 1, 2)
    assert registry.policy == {"dispatch": "load", "scaling": {"enabled": True, "low_freeness": 5.0,
                                                               "high_freeness": 50.0, "min_instances": 1,
                                                               "max_instances": 2}}
    await align_stored_scaling(registry, 1, 2)
    assert registry.writes == 1  # already aligned: not written again
    for nothing_stored in (None, {"dispatch": "load"}):
        untouched = PolicyRegistry(nothing_stored)
        await align_stored_scaling(untouched, 1, 2)
        assert untouched.writes == 0  # the manager uses the launcher's flags


class FakeEtcd:
    is_running, pid, returncode, log_path = True, 2, None, None


class WatchedCluster(FakeCluster):
    """What `_watch` needs of a LocalCluster that follows scaling."""

    def __init__(self) -> None:
        super().__init__("instance-0")
        self.spec = type("Spec", (), {"follows_scaling": True})()
        self.etcd = FakeEtcd()
        self.supervisor = Supervisor(RestartPolicy())
        self.is_state_stale = False

    @contextlib.asynccontextmanager
    async def registry(self):
        yield None


async def test_a_signal_while_the_follower_starts_an_instance_stops_the_watch_at_once(monkeypatch):
    """An instance that loads its model for minutes: before, Ctrl-C waited for it (up to the 180 s health wait)."""
    starting = asyncio.Event()

    async def slow_follower(cluster, registry, stop):
        starting.set()
        await asyncio.sleep(3600)  # add_instance waiting for a model to load; stop is looked at only between steps
    monkeypatch.setattr(launcher, "follow_scaling", slow_follower)
    stop = asyncio.Event()
    watch = asyncio.create_task(launcher._watch(WatchedCluster(), stop))
    await starting.wait()
    stop.set()
    await asyncio.wait_for(watch, 3.0)
