"""Supervisor: which child exits are reported, restarted after a growing delay, or given up."""

from __future__ import annotations

import pytest
import structlog
import structlog.testing

from services.cluster.supervisor import Action, RestartPolicy, Supervisor, exited_cleanly, supervise_step

pytestmark = pytest.mark.timeout(10)

POLICY = RestartPolicy(burst=3, window_s=100.0, first_delay_s=1.0, max_delay_s=3.0)


def test_a_running_child_is_left_alone():
    supervisor = Supervisor(POLICY)
    assert [supervisor.action("a", False, t) for t in range(5)] == [Action.NONE] * 5


def test_an_exit_is_reported_then_restarted_after_the_delay():
    supervisor = Supervisor(POLICY)
    assert supervisor.action("a", True, 10.0) is Action.REPORT
    assert supervisor.action("a", True, 10.5) is Action.NONE
    assert supervisor.action("a", True, 11.0) is Action.RESTART


def test_the_delay_doubles_up_to_its_cap_and_the_budget_ends_in_giving_up():
    supervisor = Supervisor(POLICY)
    now, delays = 0.0, []
    for _ in range(POLICY.burst):
        assert supervisor.action("a", True, now) is Action.REPORT
        down_at = now
        while supervisor.action("a", True, now) is not Action.RESTART:
            now += 0.5
        delays.append(now - down_at)
        assert supervisor.action("a", False, now + 0.1) is Action.NONE  # it runs again, then exits again
    assert delays == [1.0, 2.0, 3.0]
    assert supervisor.action("a", True, now + 1) is Action.GIVE_UP  # the exit that finds the budget spent
    assert supervisor.action("a", True, now + 500) is Action.NONE  # given up for good, said once


def test_restarts_older_than_the_window_no_longer_count():
    supervisor = Supervisor(POLICY)
    for start in (0.0, 10.0, 20.0):
        supervisor.action("a", True, start)
        assert supervisor.action("a", True, start + 5) is Action.RESTART
    supervisor.action("a", True, 200.0)  # the three restarts are more than window_s ago
    assert supervisor.action("a", True, 201.0) is Action.RESTART


def test_each_child_has_its_own_budget():
    supervisor = Supervisor(RestartPolicy(burst=1, first_delay_s=0.0))
    for name in ("a", "b"):
        supervisor.action(name, True, 0.0)
        assert supervisor.action(name, True, 0.0) is Action.RESTART


def test_a_clean_exit_is_reported_and_left_down():
    supervisor = Supervisor(RestartPolicy(first_delay_s=0.0))
    assert supervisor.action("a", True, 0.0, failed=False) is Action.REPORT
    assert supervisor.action("a", True, 100.0, failed=False) is Action.NONE


def test_restart_no_only_reports():
    supervisor = Supervisor(RestartPolicy(on_failure=False))
    assert supervisor.action("a", True, 0.0) is Action.REPORT
    assert supervisor.action("a", True, 1000.0) is Action.NONE


class FakeChild:
    def __init__(self, name: str, alive: bool = False, stopping: bool = False, fails: bool = False,
                 returncode: int | None = -9, any_exit_fails: bool = False) -> None:
        self.name, self.alive, self.stopping, self.fails = name, alive, stopping, fails
        self.any_exit_fails = any_exit_fails
        self.pid, self.returncode, self.num_starts = 100, returncode, 0

    def is_alive(self) -> bool:
        self.reaped = True  # as Popen.poll(): only now is its returncode known
        return self.alive

    @property
    def returncode(self) -> int | None:
        return self._returncode if self.reaped else None

    @returncode.setter
    def returncode(self, value: int | None) -> None:
        self._returncode, self.reaped = value, False

    def is_stopping(self) -> bool:
        return self.stopping

    async def restart(self) -> int:
        self.num_starts += 1
        if self.fails:
            raise RuntimeError("port in use")
        self.alive, self.pid = True, self.pid + 1
        return self.pid


async def test_supervise_step_restarts_exited_children_only():
    supervisor = Supervisor(RestartPolicy(first_delay_s=0.0))
    exited, running, stopped = FakeChild("exited"), FakeChild("running", alive=True), FakeChild("stopped", stopping=True)
    clean, etcd = FakeChild("clean", returncode=0), FakeChild("etcd", returncode=0, any_exit_fails=True)
    children = [exited, running, stopped, clean, etcd]
    with structlog.testing.capture_logs() as logs:
        assert await supervise_step(supervisor, children, 0.0)  # first look: reported (cluster.json changes)
    said = {entry["name"]: entry["then"] for entry in logs if entry["event"] == "process_exited"}
    assert [entry["returncode"] for entry in logs if entry["name"] == "etcd"] == [0]  # its real status, logged
    assert said == {"exited": "it starts again", "etcd": "it starts again",
                    "clean": "it stays down (it exited cleanly, as after a SIGTERM)"}
    assert await supervise_step(supervisor, children, 0.0)
    assert [c.num_starts for c in children] == [1, 0, 0, 0, 1]
    assert exited.alive and exited.pid == 101


async def test_a_failed_restart_counts_against_the_budget_and_the_launcher_goes_on():
    supervisor = Supervisor(RestartPolicy(burst=2, first_delay_s=0.0))
    child = FakeChild("broken", fails=True)
    for now in range(10):
        await supervise_step(supervisor, [child], float(now))
    assert child.num_starts == 2 and supervisor.has_given_up("broken")


async def test_children_that_left_are_forgotten_so_autoscaling_for_weeks_keeps_a_bounded_table():
    """Scaling retires instances and starts new ones under new names (instance-3, instance-4, ...): a
    child gone from the launcher's list leaves no history behind, while the others keep theirs."""
    supervisor = Supervisor(RestartPolicy(burst=1, first_delay_s=0.0))
    given_up = FakeChild("etcd", fails=True)
    for now in range(3):
        await supervise_step(supervisor, [given_up], float(now))
    assert supervisor.has_given_up("etcd")
    for index in range(1000):  # add one, retire the one before: one instance at a time besides etcd
        await supervise_step(supervisor, [given_up, FakeChild(f"instance-{index}", alive=True)], 10.0 + index)
    assert supervisor.num_known == 2
    assert supervisor.has_given_up("etcd")  # still listed: its history stays


def test_the_launcher_counts_a_failed_child_as_running_until_the_supervisor_gives_up(tmp_path):
    import pathlib

    from services.cluster.launcher import ClusterSpec, LocalCluster

    def cluster(on_failure: bool) -> LocalCluster:
        return LocalCluster(ClusterSpec(
            model_dir=pathlib.Path("/m"), roles=("both",), num_managers=1, engine="sim", transfer_backend="grpc",
            http_port=8000, admin_port=50051, state_dir=tmp_path, cluster="ferry", threads_per_instance=1,
            kv_cache_mib=16, log_format="console", restart=RestartPolicy(on_failure=on_failure, burst=1)))

    def child(alive: bool = False, returncode: int | None = -9) -> FakeChild:
        return FakeChild("instance-0", alive=alive, returncode=returncode)

    restarting = cluster(on_failure=True)
    assert restarting.will_run(child(alive=True)) and restarting.will_run(child())
    assert not restarting.will_run(child(returncode=0))
    for now in (0.0, 10.0, 20.0, 30.0):  # exits, restarts once (burst=1), exits, is given up
        restarting.supervisor.action("instance-0", True, now)
    assert restarting.supervisor.has_given_up("instance-0") and not restarting.will_run(child())
    assert not cluster(on_failure=False).will_run(child())


def test_cluster_json_lists_no_pid_for_a_child_that_exited_and_names_every_metrics_url(tmp_path):
    import pathlib
    import types

    from services.cluster.launcher import ClusterSpec, LocalCluster
    from services.cluster.processes import ServiceProcess

    cluster = LocalCluster(ClusterSpec(
        model_dir=pathlib.Path("/m"), roles=("both",), num_managers=1, engine="sim", transfer_backend="grpc",
        http_port=8000, admin_port=50051, state_dir=tmp_path, cluster="ferry", threads_per_instance=1,
        kv_cache_mib=16, log_format="console"))
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379", pid=7, is_running=True)
    exited = ServiceProcess("instance-0", "instance", [], "127.0.0.1:1", tmp_path, metrics_url="http://x/metrics")
    exited.popen = types.SimpleNamespace(pid=8, returncode=0, poll=lambda: 0)
    cluster.processes.append(exited)
    processes = {p["name"]: p for p in cluster.state()["processes"]}
    assert processes["etcd"] == {"name": "etcd", "pid": 7, "address": "127.0.0.1:2379",
                                 "metrics_url": "http://127.0.0.1:2379/metrics"}
    assert processes["instance-0"]["pid"] is None and processes["instance-0"]["metrics_url"] == "http://x/metrics"


def test_a_child_ended_by_sigterm_or_sigint_exited_cleanly_as_systemd_counts_it():
    """An operator's `kill PID` before the child had installed its own handler (it then exits 0)."""
    assert exited_cleanly(0) and exited_cleanly(-15) and exited_cleanly(-2)
    assert not exited_cleanly(1) and not exited_cleanly(-9) and not exited_cleanly(None)
