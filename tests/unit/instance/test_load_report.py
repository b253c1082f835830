"""The instance servicer's load report, from a real engine runner (no sockets)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.gen.ferry.v1 import common_pb2
from services.instance.config import InstanceRole
from services.instance.server import InstanceIdentity, InstanceServicer
from tests.unit.instance import test_migration
from tests.unit.instance.test_migration import PROMPT, SAMPLING

pytestmark = pytest.mark.timeout(60)
pair, tiny = test_migration.pair, test_migration.tiny  # its fixtures: two engine runners on the tiny model


async def test_the_load_report_carries_the_preemptions_so_ferryctl_can_show_kv_pressure(pair):
    """Preemptions were in the instance's /metrics alone: `ferryctl top` and `instances` had no way to show them."""
    a, _ = pair
    servicer = InstanceServicer(a.runner)
    servicer.identity = InstanceIdentity("a", "127.0.0.1:2", InstanceRole.BOTH, "m", 1024, common_pb2.KvGeometry())
    assert servicer.load_report().num_preemptions == 0
    long = dataclasses.replace(SAMPLING, max_tokens=200)  # 55 blocks each: 4 at once need 220 of the 160

    async def run(request_id: str) -> None:
        async for _ in await a.runner.add(request_id, PROMPT, long):
            pass
    await asyncio.gather(*(run(f"r-{i}") for i in range(4)))
    assert a.runner.num_preemptions > 0
    assert servicer.load_report().num_preemptions == a.runner.num_preemptions
