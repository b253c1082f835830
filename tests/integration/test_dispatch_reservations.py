"""A dispatched request counts once in the leader's view: as a reservation until a load report of its
instance counts it, then in that report only. Real processes: a manager and two (sim) instances on
a real etcd; this test is the frontend (Dispatch, then Generate on the chosen instance).

Before, a report dropped only reservations IN_TRANSIT_S (0.5 s) old: ListInstances showed num_running
6 and 6 for 3 + 3 streams for half a second (black-box run), and dispatch and migration saw that too."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.manager.client import ManagerClient
from services.manager.cluster_view import IN_TRANSIT_S
from tests.integration.ops_cluster import ops_cluster

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 6
DEFAULT_MAX_NUM_SEQS = 64  # the instances' --max-num-seqs (ops_cluster does not set it)
WATCH_S = 1.0  # past IN_TRANSIT_S: a reservation kept that long would show


@pytest.fixture(scope="module")
def ops(etcd, tiny_model_dir, tmp_path_factory):
    with ops_cluster(etcd, tiny_model_dir, tmp_path_factory.mktemp("logs")) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def long_stream(address: str, request_id: str) -> AsyncIterator[asyncio.Task]:
    """Generate on `address`; yields the task that ends with the stream's first chunk. Cancelled on exit."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = instance_pb2_grpc.InstanceServiceStub(channel).Generate(instance_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=[5, 17, 42, 99, 7, 3],
            sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)), timeout=60)
        first = asyncio.ensure_future(call.read())
        try:
            yield first
        finally:
            first.cancel()
            call.cancel()


async def test_six_streams_count_six_running_not_twelve(ops):
    async with ManagerClient(ops.admin_address, timeout_s=2.0) as manager, contextlib.AsyncExitStack() as streams:
        # Both reported (ops_cluster waits for it): one still in its first grace gets no dispatch while the
        # other has reported, and all six went to the other (a first report late under load).
        heard = [(r.instance_id, round(r.report_age_s, 3)) for r in await manager.list_instances()]
        started = time.monotonic()
        placements = [await manager.dispatch(f"count-{uuid.uuid4().hex[:6]}-{n}", 6) for n in range(NUM_STREAMS)]
        assert sorted(p.instance_id for p in placements) == sorted(["instance-0", "instance-1"] * 3), (
            [p.instance_id for p in placements], heard)
        firsts = [await streams.enter_async_context(long_stream(p.address, f"count-{n}-{uuid.uuid4().hex[:6]}"))
                  for n, p in enumerate(placements)]
        await asyncio.wait_for(asyncio.gather(*firsts), 30)
        all_started_s = time.monotonic() - started
        samples = []  # (seconds since the first dispatch, num_running summed, num_waiting summed)
        while (now := time.monotonic() - started) < WATCH_S:
            rows = await manager.list_instances()
            samples.append((round(now, 3), sum(r.num_running for r in rows), sum(r.num_waiting for r in rows)))
            await asyncio.sleep(0.02)
    # Each instance's batch slots (the default --max-num-seqs, from its etcd record) and those its 3 streams
    # leave free (from its load report).
    assert sorted((r.max_num_seqs, r.num_free_slots) for r in rows) == [(DEFAULT_MAX_NUM_SEQS,
                                                                         DEFAULT_MAX_NUM_SEQS - 3)] * 2, rows
    if all_started_s > IN_TRANSIT_S - 0.15:
        pytest.skip(f"the streams took {all_started_s:.2f} s to start: past IN_TRANSIT_S, nothing shows twice")
    assert all(running + waiting <= NUM_STREAMS for _, running, waiting in samples), samples
    within = [s for s in samples if s[0] < IN_TRANSIT_S - 0.05]  # where a kept reservation would still count
    assert within and within[-1][1] == NUM_STREAMS, (all_started_s, samples)
    assert samples[-1][1] == NUM_STREAMS, samples
