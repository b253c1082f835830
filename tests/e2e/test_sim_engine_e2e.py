"""The sim engine through the whole cluster: `services.cluster up --engine sim` starts
instances with no weights, a latency model instead of the forward pass, and the same
scheduler, KV cache and migration. A flood onto one instance spreads by live migration,
and every request's tokens equal those of one local sim engine, never migrated (the sim's
tokens are computed from the KV cache, so lost or garbled blocks would show)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time

import pytest

from services.instance.engine.factory import EngineSpec
from services.instance.engine.sim_model import SimLatency
from services.common.gen.ferry.v1 import manager_pb2
from tests.e2e.conftest import launched_cluster, local_reference, model_name, pid_of
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


async def test_a_sigtermed_instance_migrates_its_requests_away_before_it_exits(cluster, admin, client, reference):
    """Runs last (it stops an instance). SIGTERM, as from `systemctl stop` or a rolling update: the
    instance drains itself, the leader live-migrates its streams elsewhere (no resume, no recompute),
    and it exits 0, which the launcher leaves down."""
    await set_policy(admin, dispatch="flood", migration_enabled=False)
    prompts = [f"a stream that outlives its instance {i}" for i in range(3)]
    streams = [await client.completions.create(model=model_name(cluster), prompt=p, max_tokens=1000, temperature=0,
                                               stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
               for p in prompts]
    firsts = [await anext(aiter(stream)) for stream in streams]
    assert {await instance_running(admin, first.id) for first in firsts} == {FLOODED}
    os.kill(pid_of(cluster, FLOODED), signal.SIGTERM)
    results = [token_ids_of(first) + [t async for chunk in stream for t in token_ids_of(chunk)]
               for stream, first in zip(streams, firsts)]
    assert results == reference(prompts, 1000)
    reply = await admin.ListMigrations(manager_pb2.ListMigrationsRequest(instance_id=FLOODED), timeout=5)
    moved = {m.request_id for m in reply.migrations if m.outcome == "committed" and m.trigger == "drain"}
    assert moved == {first.id for first in firsts}  # every stream moved with its KV, none resumed
    exited = await asyncio.to_thread(launcher_line, cluster, "process_exited", FLOODED)
    assert "returncode=0" in exited and "it stays down" in exited, exited


def launcher_line(cluster: dict, event: str, name: str, timeout_s: float = 30.0) -> str:
    """The launcher's log line of `event` for child `name` (the launcher, not us, is its parent)."""
    state_dir = pathlib.Path(cluster["state_dir"])
    log_path = state_dir.parent / f"{state_dir.name}-launcher.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if event in line and f"name={name} " in line:
                return line
        time.sleep(0.2)
    raise TimeoutError(f"no {event} for {name} in {log_path}")
