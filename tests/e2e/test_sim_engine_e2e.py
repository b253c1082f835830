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
from services.common.gen.ferry.v1 import manager_pb2
from tests.e2e.conftest import launched_cluster, local_reference, model_name
from tests.e2e.test_migration_e2e import FLOODED, NUM_INSTANCES, flood, set_policy

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



MAX_TOKENS = 300


async def test_the_prefix_policy_keeps_a_prefix_on_its_instance_and_every_token_exact(cluster, admin, client,
                                                                                     reference):
    """Streams are held open so the instances are not idle: `load` would send each next request elsewhere,
    `prefix` sends a shared prefix back to the instance that has it (its queue is within the slack)."""
    await set_policy(admin, dispatch="prefix", migration_enabled=False)
    shared = "You are a careful assistant. Answer in one short sentence, and never use more words than needed. "
    other = "Translate the following sentence into French, keeping the tone and the punctuation exactly as is. "
    prompts = [shared + "Question one?", shared + "Question two?", other + "Bonjour.", shared + "Question three?"]
    streams, placed = [], []
    for prompt in prompts:
        stream = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        first = await anext(aiter(stream))
        placed.append(await instance_running(admin, first.id))
        streams.append((stream, token_ids_of(first)))
    results = [first_ids + [t async for chunk in stream for t in token_ids_of(chunk)] for stream, first_ids in streams]
    assert placed[1] == placed[3] == placed[0], placed  # the shared prefix stayed where it was first sent
    assert placed[2] != placed[0], placed  # a new prefix went by load, away from the busy instance
    assert results == reference(prompts, MAX_TOKENS)
    await set_policy(admin, dispatch="load")


def token_ids_of(chunk) -> list[int]:
    return (chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else []


async def instance_running(admin, request_id: str) -> str:
    reply = await admin.ListRequests(manager_pb2.AdminListRequestsRequest(), timeout=5)
    return next(r.instance_id for r in reply.requests if r.request_id == request_id)
