"""Scaling end to end: the launcher with --autoscale-max-instances follows the leader's decisions.

A sim cluster starts with one instance. A band the cluster is below makes the leader ask
for one more: the launcher starts instance-1, which registers and serves. With streams
running on both, a band the cluster is above makes the leader retire one: it drains (its
streams migrate), the launcher stops it, and its drain mark goes away. Every stream ends
with exactly the reference tokens.
"""

from __future__ import annotations

import json
import pathlib

import grpc
import openai
import pytest

from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.common.registry import Registry
from tests.e2e.conftest import instances, launched_cluster, model_name, wait_for
from tests.e2e.test_sim_engine_e2e import instance_running, token_ids_of
from tests.e2e.test_sim_engine_e2e import reference as reference  # noqa: F401 — the sim engine's reference fixture

pytestmark = pytest.mark.timeout(240)


async def set_band(admin, low: float, high: float) -> None:
    await admin.SetPolicy(manager_pb2.Policy(scaling_low_freeness=low, scaling_high_freeness=high), timeout=5)


MAX_TOKENS = 900  # sim steps of 8 ms: the streams outlast the scaling ticks that retire an instance


async def test_the_leader_adds_and_retires_instances_and_the_launcher_follows(tiny_model_dir, tmp_path, monkeypatch,
                                                                               reference):
    monkeypatch.setenv("FERRY_MANAGER_SCALING_COOLDOWN_S", "1")
    state_dir = tmp_path / "state"
    with launched_cluster(tiny_model_dir, state_dir, "--instances", "1", "--engine", "sim", "--kv-cache-mib", "16",
                          "--autoscale-max-instances", "2") as cluster:
        # The client closes on this test's loop (left to the GC, it closes in a task on a later test's loop and fails).
        async with (grpc.aio.insecure_channel(cluster["admin_address"]) as channel,
                    openai.AsyncOpenAI(base_url=f"{cluster['frontend_url']}/v1", api_key="unused", max_retries=0,
                                       timeout=120) as client):
            admin = manager_pb2_grpc.AdminServiceStub(channel)
            policy = await admin.GetPolicy(manager_pb2.GetPolicyRequest(), timeout=5)
            assert policy.scaling_enabled and (policy.scaling_min_instances, policy.scaling_max_instances) == (1, 2)

            await set_band(admin, 1e9, 2e9)  # every cluster is below it: add, up to 2

            async def two_serving():
                found = await instances(admin)
                return (sorted(found) == ["instance-0", "instance-1"] and all(i.state == 1 for i in found.values())
                        and _instance_names(state_dir) == ["instance-0", "instance-1"])  # 1: INSTANCE_STATE_SERVING
            await wait_for(two_serving, 120, "a second instance serving and in cluster.json")

            prompts = [f"Stream {i}: count the steps of a long staircase." for i in range(4)]
            streams = [await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, stream=True,
                                                       extra_body={"return_token_ids": True, "ignore_eos": True})
                       for prompt in prompts]
            firsts = [await anext(aiter(stream)) for stream in streams]
            on = {await instance_running(admin, first.id) for first in firsts}
            assert on == {"instance-0", "instance-1"}, on  # load spreads them

            await set_band(admin, -2e9, -1e9)  # every cluster is above it: retire one, down to 1
            results = [token_ids_of(first) + [t async for chunk in stream for t in token_ids_of(chunk)]
                       for stream, first in zip(streams, firsts)]
            assert results == reference(prompts, MAX_TOKENS)  # the retired instance's streams moved, exactly

            async def one_left():
                found = list(await instances(admin))
                return len(found) == 1 and _instance_names(state_dir) == found
            await wait_for(one_left, 120, "one instance retired and stopped")
            retired = ({"instance-0", "instance-1"} - set(await instances(admin))).pop()
            history = await admin.ListMigrations(manager_pb2.ListMigrationsRequest(instance_id=retired), timeout=5)
            assert any(m.src_instance_id == retired and m.trigger == "drain" and m.outcome == "committed"
                       for m in history.migrations), history  # it had streams, and they moved
            async with Registry([cluster["etcd_endpoint"]], cluster["cluster"]) as registry:
                async def forgotten():  # its drain mark goes, so a later instance-1 would serve
                    target = await registry.get_json("scaling/target")
                    return (await registry.get_json(f"config/drain/{retired}") is None
                            and (target["num_instances"], target["draining"], target["stoppable"]) == (1, [], []))
                await wait_for(forgotten, 30, "the retired instance's drain mark deleted and the target settled")


def _instance_names(state_dir: pathlib.Path) -> list[str]:
    state = json.loads((state_dir / "cluster.json").read_text())
    return sorted(p["name"] for p in state["processes"] if p["name"].startswith("instance-"))
