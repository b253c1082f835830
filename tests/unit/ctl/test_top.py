import asyncio
import io
import subprocess
import sys

from services.common.etcd_launcher import free_port
from services.ctl.records import ClusterStatus
from services.ctl.top import PREEMPTED, SERVED, CounterRate, run_top
from tests.unit.ctl.test_tables import instance


def test_throughput_is_the_served_counter_rate():
    throughput = CounterRate(SERVED)
    assert throughput.update([instance(served=10)], now=100.0) == {}
    assert throughput.update([instance(served=14)], now=102.0) == {"instance-0": 2.0}
    assert throughput.update([instance(served=3)], now=103.0) == {"instance-0": 0.0}  # restarted: no negative rate


def test_throughput_skips_an_instance_the_manager_has_not_heard_from():
    """After a leader change its count reads 0 until the instance reports: no spike of its whole count after."""
    throughput = CounterRate(SERVED)
    throughput.update([instance(served=1000)], now=100.0)
    assert throughput.update([instance(served=0, report_age_s=-1.0)], now=101.0) == {}
    assert throughput.update([instance(served=1006)], now=103.0) == {"instance-0": 2.0}


def test_preemptions_per_second_are_the_preemption_counter_rate():
    preempted = CounterRate(PREEMPTED)
    assert preempted.update([instance(preemptions=4)], now=100.0) == {}
    assert preempted.update([instance(preemptions=10)], now=104.0) == {"instance-0": 1.5}


def test_a_snapshot_of_a_manager_that_does_not_answer_exits_non_zero():
    """`ferryctl top --iterations 1` in a script: before, it printed the error and exited 0."""
    result = subprocess.run([sys.executable, "-m", "services.ctl", "--admin", f"127.0.0.1:{free_port()}",
                             "--timeout-s", "2", "top", "--iterations", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "admin 127.0.0.1:" in result.stdout


class _Admin:
    """The calls `top` makes, answering with a fixed status."""

    address = "127.0.0.1:50051"

    def __init__(self, status: ClusterStatus) -> None:
        self._status = status

    async def cluster_status(self) -> ClusterStatus:
        return self._status

    async def list_instances(self) -> list:
        return [instance()]

    async def list_migrations(self) -> list:
        return []


def _status(leader_id: str, answered_by: str) -> ClusterStatus:
    return ClusterStatus(leader_id, "10.0.0.1:50051" if leader_id else "", answered_by, "load", 1, 1, 0, 0, 2, 1, 9, 42.5)


def _snapshot(status: ClusterStatus) -> list[str]:
    out = io.StringIO()
    assert asyncio.run(asyncio.wait_for(run_top(_Admin(status), 1.0, 1, as_json=False, out=out), 10))
    return out.getvalue().splitlines()


def test_top_header_says_which_manager_answered():
    """The header named the leader but not the manager whose view the frame was (ListInstances' answered_by)."""
    header, totals, *_ = _snapshot(_status("manager-0", "manager-0"))
    assert "admin 127.0.0.1:50051  answered by manager-0  leader manager-0 (10.0.0.1:50051)  policy load" in header
    assert totals.startswith("instances 1:") and len(header) <= 120


def test_top_says_a_view_that_is_not_the_leaders_is_worth_little():
    """A standby answering alone, or any manager while none leads, has no load reports: `instances` said so, `top`
    did not."""
    header, _, note, *_ = _snapshot(_status("manager-0", "manager-1"))
    assert "answered by manager-1  leader manager-0" in header and note.startswith("not the leader's view: manager-1")
    header, _, note, *_ = _snapshot(_status("", "manager-1"))
    assert "answered by manager-1  leader none elected" in header and note.startswith("no leader: manager-1's view")


def test_top_header_of_an_older_manager_that_does_not_say_who_answered():
    header, _, blank, *_ = _snapshot(_status("manager-0", ""))
    assert "answered by" not in header and blank == ""
