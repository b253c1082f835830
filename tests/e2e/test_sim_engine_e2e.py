"""The sim engine through the whole cluster: `services.cluster up --engine sim` starts
instances with no weights, a latency model instead of the forward pass, and the same
scheduler, KV cache and migration. A flood onto one instance spreads by live migration,
and every request's tokens equal those of one local sim engine, never migrated (the sim's
tokens are computed from the KV cache, so lost or garbled blocks would show)."""

from __future__ import annotations

import os

import pytest

from services.instance.engine.factory import EngineSpec
from services.instance.engine.sim_model import SimLatency
from tests.e2e.conftest import launched_cluster, local_reference
from tests.e2e.test_migration_e2e import FLOODED, NUM_INSTANCES, flood

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp("sim"), "--engine", "sim",
                          "--instances", str(NUM_INSTANCES), "--kv-cache-mib", "16") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    spec = EngineSpec(tiny_model_dir, kv_name=f"ferry-e2e-sim-ref-{os.getpid()}", num_blocks=2048,
                      sim_latency=SimLatency(step_ms=0.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0))
    with local_reference(spec) as generate:
        yield generate


async def test_a_flood_spreads_by_migration_and_keeps_every_token(cluster, admin, client, reference):
    destinations = await flood(cluster, admin, client, reference, num_requests=16, max_tokens=300)
    assert destinations - {FLOODED}, destinations
