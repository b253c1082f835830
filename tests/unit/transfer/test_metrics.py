"""Transfer metrics count outcomes and bytes."""

import pytest
from prometheus_client import REGISTRY

from services.transfer.metrics import observed_transfer

pytestmark = pytest.mark.timeout(10)


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_successful_and_failed_transfers_are_counted():
    ok_before = value("ferry_transfer_transfers_total", backend="shm", outcome="ok")
    bytes_before = value("ferry_transfer_bytes_total", backend="shm")
    failed_before = value("ferry_transfer_transfers_total", backend="shm", outcome="failed")
    with observed_transfer("shm") as moved:
        moved.append(4096)
    with pytest.raises(RuntimeError), observed_transfer("shm"):
        raise RuntimeError("peer died")
    assert value("ferry_transfer_transfers_total", backend="shm", outcome="ok") == ok_before + 1
    assert value("ferry_transfer_bytes_total", backend="shm") == bytes_before + 4096
    assert value("ferry_transfer_transfers_total", backend="shm", outcome="failed") == failed_before + 1
