"""A stream whose only instance froze, or was killed and started again, longer than the old resumes' waits:
the frontend's resume finds no serving instance (the instance's 2 s lease lapsed) and waits for one to register
(--resume-wait-s, 30 s), spending no resume, so the stream gives the reference tokens. Before, each look that
found nothing spent one of --max-resumes (3) with blind waits of 1, 2, 4 s: the stream failed ~7 s after it
broke ("failed after 3 resumes ... no serving instance is known") though the instance came back.

A real cluster (etcd, a manager, one instance, a frontend: what `services.cluster up` starts), a tiny model.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.fault_cluster import FaultCluster, FaultTimings, Reference, Stream, client_session, wait_for_tokens
from tests.e2e.fault_cluster import fault_reference  # noqa: F401 (the module's `reference` fixture)

pytestmark = pytest.mark.timeout(240)

INSTANCE = "instance-0"
# The stream breaks 5-10 s into a freeze (the keepalive ping); the old resumes gave up 7 s later: by 17 s.
FREEZE_S = 20.0
DOWN_S = 9.0  # a killed instance is started again this long after the kill (the old resumes gave up at ~7 s)
RESUMES = "ferry_frontend_stream_resumes_total"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with FaultCluster(tiny_model_dir, tmp_path_factory.mktemp("lone"), num_instances=1, num_managers=1,
                      timings=FaultTimings(instance_lease_ttl_s=2.0)).running() as cluster:
        yield cluster


def streams(tag: str) -> list[Stream]:
    """One greedy, one seeded; long enough to still run when the fault lands."""
    return [Stream(f"{tag} greedy says", 400), Stream(f"{tag} seeded says", 400, 0.8, 4242)]


async def run_through(cluster: FaultCluster, reference: Reference, tag: str, fault) -> None:
    """Streams through `fault` (an async callable): each gets the reference tokens and spends one resume."""
    async with client_session() as session:
        resumes_before = await cluster.metric(cluster.frontend_url, RESUMES)
        ongoing = streams(tag)
        tasks = [asyncio.create_task(s.run(session, cluster.frontend_url, cluster.model_name)) for s in ongoing]
        await wait_for_tokens(ongoing, 8)
        await fault()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for stream, (tokens, text) in zip(ongoing, reference.outputs(ongoing)):
            assert stream.is_ok, (stream.request_id, stream.error)
            assert stream.token_ids == tokens and stream.text == text, f"{stream.request_id} differs"
        # the break spent one resume; the wait for the instance none (a second break may come on its return)
        assert await cluster.metric(cluster.frontend_url, RESUMES) - resumes_before <= 2 * len(ongoing)


async def test_a_lone_instance_frozen_past_its_lease_serves_its_streams_again(cluster, reference):
    async def freeze() -> None:
        cluster.freeze(INSTANCE)
        try:
            await asyncio.sleep(FREEZE_S)
        finally:
            cluster.thaw(INSTANCE)

    await run_through(cluster, reference, "frozen", freeze)


async def test_a_lone_instance_killed_and_started_again_serves_its_streams_again(cluster, reference):
    async def kill_and_restart() -> None:
        cluster.kill(INSTANCE)
        await asyncio.sleep(DOWN_S)
        await cluster.restart(INSTANCE)

    await run_through(cluster, reference, "restarted", kill_and_restart)
