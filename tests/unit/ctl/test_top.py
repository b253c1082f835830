import subprocess
import sys

from services.common.etcd_launcher import free_port
from services.ctl.top import PREEMPTED, SERVED, CounterRate
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
