"""The cluster through the OpenAI client, as a user sees it (issue: the cluster and `make run`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import grpc
import openai
import pytest

from services.cluster.processes import ROOT
from services.common.gen.ferry.v1 import instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams
from services.instance.engine.tokenizer import Tokenizer
from tests.deploy.test_grafana import queried_metrics
from tests.e2e.conftest import address_of, pid_of
from tests.integration.metrics_scrape import exposition_problems

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(two_instance_cluster):
    return two_instance_cluster


@pytest.fixture
async def client(cluster) -> AsyncIterator[openai.AsyncOpenAI]:
    # Closed on this test's loop: left to the GC, openai's __del__ closes it in a task on whatever loop runs then
    # (a later test's), which fails ('Event loop is closed') with no one to read the error.
    async with openai.AsyncOpenAI(base_url=f"{cluster['frontend_url']}/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        yield client


def model_name(cluster) -> str:
    return os.path.basename(cluster["model"])


async def list_instances(address: str) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await manager_pb2_grpc.AdminServiceStub(channel).ListInstances(
            manager_pb2.ListInstancesRequest(), timeout=5)
    return list(response.instances)


async def test_at_ready_the_leader_holds_a_load_report_of_every_instance(cluster):
    """First in this module, right after cluster.json appeared: an instance without a report yet is passed over
    by dispatch while another has reported, so a burst sent at `ready` all went to the first to report."""
    assert {i.instance_id: i.report_age_s >= 0 for i in await list_instances(cluster["admin_address"])} == \
        {"instance-0": True, "instance-1": True}


async def test_completions_and_chat_streaming_and_not(client, cluster):
    model = model_name(cluster)
    completion = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                             stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == completion.choices[0].text
    chat_stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=8, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in chat_stream if chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content


async def test_greedy_token_ids_equal_the_engines_own(client, cluster, tiny_model_dir):
    prompt = "The quick brown fox"
    completion = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=16, temperature=0,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids = completion.choices[0].model_extra["token_ids"]
    prompt_ids = Tokenizer.from_dir(tiny_model_dir).encode(prompt)
    loaded = build_engine(EngineSpec(tiny_model_dir, kv_name=f"ferry-e2e-ref-{os.getpid()}", num_blocks=64))
    try:
        reference = loaded.engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finally:
        loaded.close()
    assert token_ids == reference[0]


async def test_concurrent_requests_spread_over_both_instances(client, cluster):
    before = {i.instance_id: i.num_dispatched for i in await list_instances(cluster["admin_address"])}
    results = await asyncio.gather(*(
        client.completions.create(model=model_name(cluster), prompt=f"request number {i}", max_tokens=16,
                                  temperature=0, extra_body={"ignore_eos": True})
        for i in range(32)))
    assert all(r.usage.completion_tokens == 16 for r in results)
    after = {i.instance_id: i.num_dispatched for i in await list_instances(cluster["admin_address"])}
    shares = {instance_id: after[instance_id] - before.get(instance_id, 0) for instance_id in after}
    assert len(shares) == 2 and all(share >= 4 for share in shares.values()), shares


async def test_every_process_serves_the_metrics_cluster_json_names(client, cluster):
    """Each in valid Prometheus text, and together every metric the Grafana dashboard queries."""
    await client.completions.create(model=model_name(cluster), prompt="count me", max_tokens=4)
    prefixes = {"manager": "ferry_manager_", "transfer": "ferry_transfer_", "instance": "ferry_instance_",
                "frontend": "ferry_frontend_"}
    exported: set[str] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for process in cluster["processes"]:
            kind = process["name"].rsplit("-", 1)[0]
            if kind == "etcd":
                continue
            async with http.get(process["metrics_url"]) as response:
                text = await response.text()
            assert response.status == 200 and prefixes[kind] in text, process["name"]
            assert not exposition_problems(text), (process["name"], exposition_problems(text))
            exported |= {name for line in text.splitlines() if line.startswith("# TYPE ")
                         for name in (line.split()[2], line.split()[2] + "_total")}
    assert not queried_metrics() - exported, f"the dashboard queries what no process exports: {queried_metrics() - exported}"


async def test_bad_input_gets_400_with_a_message(client, cluster):
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=model_name(cluster), prompt="x", max_tokens=0)
    assert "max_tokens" in str(error.value)
    with pytest.raises(openai.NotFoundError) as missing:  # 404 model_not_found, as OpenAI answers
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert "no-such-model" in str(missing.value) and missing.value.code == "model_not_found"


async def abort_on_its_instance(cluster, is_ours) -> None:
    """Abort the first listed request `is_ours` picks, on its instance, as an operator would with grpcurl."""
    async with grpc.aio.insecure_channel(cluster["admin_address"]) as channel:
        admin = manager_pb2_grpc.AdminServiceStub(channel)
        for _ in range(100):
            listed = await admin.ListRequests(manager_pb2.AdminListRequestsRequest(), timeout=5)
            if ours := [r for r in listed.requests if is_ours(r.request_id)]:
                break
            await asyncio.sleep(0.05)
    async with grpc.aio.insecure_channel(address_of(cluster, ours[0].instance_id)) as channel:
        await instance_pb2_grpc.InstanceServiceStub(channel).Abort(
            instance_pb2.AbortRequest(request_id=ours[0].request_id), timeout=5)


async def test_an_operators_abort_on_the_instance_ends_the_request_with_finish_reason_abort(client, cluster):
    stream = await client.completions.create(model=model_name(cluster), prompt="abort me", max_tokens=1000,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = [await anext(stream)]
    await abort_on_its_instance(cluster, lambda request_id: request_id == chunks[0].id)
    chunks += [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "abort" and len(chunks) < 1000
    whole = asyncio.create_task(client.completions.create(
        model=model_name(cluster), prompt="abort me too", max_tokens=1000, temperature=0,
        extra_body={"ignore_eos": True, "request_id": "operator-abort"}))
    await abort_on_its_instance(cluster, lambda request_id: "operator-abort" in request_id)
    completion = await whole
    assert completion.choices[0].finish_reason == "abort" and completion.usage.completion_tokens < 1000


@pytest.mark.timeout(240)
async def test_leader_killed_standby_takes_over_and_requests_keep_flowing(client, cluster):
    """Runs last in this module: it kills the leader manager."""
    standby_address = address_of(cluster, "manager-1")
    os.kill(pid_of(cluster, "manager-0"), signal.SIGKILL)
    results = await asyncio.gather(*(
        client.completions.create(model=model_name(cluster), prompt=f"during failover {i}", max_tokens=8, temperature=0)
        for i in range(8)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    for _ in range(100):
        async with grpc.aio.insecure_channel(standby_address) as channel:
            status = await manager_pb2_grpc.AdminServiceStub(channel).GetClusterStatus(
                manager_pb2.GetClusterStatusRequest(), timeout=5)
        if status.leader_id == "manager-1":
            break
        await asyncio.sleep(0.2)
    assert status.leader_id == "manager-1"
    completion = await client.completions.create(model=model_name(cluster), prompt="after failover", max_tokens=8,
                                                 temperature=0)
    assert completion.usage.completion_tokens > 0
    # cluster.json lists every manager, manager-0's first; ferryctl given them all reaches the live one
    assert cluster["admin_addresses"] == [cluster["admin_address"], standby_address]
    argv = [sys.executable, "-m", "services.ctl", "--json", "--admin", ",".join(cluster["admin_addresses"]), "status"]
    ctl = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert ctl.returncode == 0 and json.loads(ctl.stdout)["answered_by"] == "manager-1", ctl.stderr
