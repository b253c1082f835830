from services.ctl.top import Throughput
from tests.unit.ctl.test_tables import instance


def test_throughput_is_the_served_counter_rate():
    throughput = Throughput()
    assert throughput.update([instance(served=10)], now=100.0) == {}
    assert throughput.update([instance(served=14)], now=102.0) == {"instance-0": 2.0}
    assert throughput.update([instance(served=3)], now=103.0) == {"instance-0": 0.0}  # restarted: no negative rate
