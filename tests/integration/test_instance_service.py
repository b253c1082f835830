"""The instance service end to end: a real process, a real etcd, real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import grpc
import llguidance
import pytest

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.registry import Registry
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams

pytestmark = pytest.mark.timeout(120)

LEASE_TTL_S = 2
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def instance(etcd, tiny_model_dir, tmp_path_factory, metrics_port):
    port = free_port()
    process = ServiceProcess(
        "instance-it", "instance",
        ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", "it-0", "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", "it", "--lease-ttl-s", str(LEASE_TTL_S),
         "--num-blocks", str(NUM_BLOCKS), "--block-size", "4", "--max-model-len", "256",
         "--metrics-port", str(metrics_port)],
        f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs"))
    process.start()
    asyncio.run(process.wait_healthy(60))
    yield process
    process.stop()


@pytest.fixture
async def stub(instance):
    async with grpc.aio.insecure_channel(instance.address) as channel:
        yield instance_pb2_grpc.InstanceServiceStub(channel)


def greedy(max_tokens: int, **fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def reference_tokens(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    # a name of its own: another pytest on the machine (or one killed mid-test) may hold a fixed one
    loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-test-reference-{uuid.uuid4().hex[:6]}", block_size=4,
                                     num_blocks=NUM_BLOCKS, max_model_len=256))
    try:
        return loaded.engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    finally:
        loaded.close()


async def collect(stub, request: instance_pb2.GenerateRequest) -> list[instance_pb2.GenerateChunk]:
    return [chunk async for chunk in stub.Generate(request, timeout=60)]


async def test_generate_streams_the_engines_greedy_tokens(stub, tiny_model_dir):
    prompt = [5, 17, 42, 99, 7, 3]
    chunks = await collect(stub, instance_pb2.GenerateRequest(request_id="g-1", prompt_token_ids=prompt, sampling=greedy(12)))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    indexes = [chunk.token_index for chunk in chunks]
    assert indexes == sorted(indexes) and indexes[0] == 0
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert tokens == reference_tokens(tiny_model_dir, prompt, 12)
    assert "".join(chunk.text for chunk in chunks)


async def test_a_prompt_prefilled_over_steps_says_where_it_started_before_its_first_token(stub, tiny_model_dir):
    """A 240-token prompt takes two steps (chunks of 224): the stream's first chunk has no token and no finish
    reason, only first_start, so a frontend that loses this instance during the prefill still resumes the
    prompt cut where it was (before, first_start came with the first token only)."""
    prompt = [(5 * i + 1) % 500 + 1 for i in range(240)]
    chunks = await collect(stub, instance_pb2.GenerateRequest(request_id="fs-1", prompt_token_ids=prompt,
                                                              sampling=greedy(4)))
    first, *rest = chunks
    assert (list(first.token_ids), first.text, first.finish_reason, first.token_index) == (
        [], "", common_pb2.FINISH_REASON_UNSPECIFIED, 0)
    assert first.HasField("first_start") and first.first_start == 0
    assert all(chunk.token_ids for chunk in rest) and rest[0].token_index == 0
    assert [t for chunk in rest for t in chunk.token_ids] == reference_tokens(tiny_model_dir, prompt, 4)


async def test_bad_input_is_invalid_argument_naming_the_field(stub):
    cases = {
        "prompt": instance_pb2.GenerateRequest(request_id="b-1", prompt_token_ids=[], sampling=greedy(4)),
        "max_tokens": instance_pb2.GenerateRequest(request_id="b-2", prompt_token_ids=[1, 2], sampling=greedy(0)),
        "temperature": instance_pb2.GenerateRequest(
            request_id="b-3", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(temperature=-1, max_tokens=4)),
        "top_p": instance_pb2.GenerateRequest(
            request_id="b-4", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(top_p=1.5, max_tokens=4)),
        "context": instance_pb2.GenerateRequest(request_id="b-5", prompt_token_ids=[1] * 300, sampling=greedy(4)),
        "grammar": instance_pb2.GenerateRequest(
            request_id="b-6", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=4,
                                                                                          grammar="start: undefined")),
        "resume_token_ids": instance_pb2.GenerateRequest(
            request_id="b-7", prompt_token_ids=[1, 2], resume_token_ids=[3, 4],
            sampling=common_pb2.SamplingParams(max_tokens=8, grammar=llguidance.LLMatcher.grammar_from_regex("x"))),
        "resume_first_start": instance_pb2.GenerateRequest(
            request_id="b-8", prompt_token_ids=[1, 2], resume_token_ids=[3], resume_first_start=3, sampling=greedy(8)),
    }
    for field, request in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in error.value.details(), (field, error.value.details())
    status = await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)
    assert status.load.num_free_blocks == NUM_BLOCKS


async def test_abort_and_cancel_free_every_block(stub):
    baseline = (await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load.num_free_blocks
    call = stub.Generate(instance_pb2.GenerateRequest(request_id="a-1", prompt_token_ids=[3] * 20, sampling=greedy(200)),
                         timeout=60)
    first = await call.read()  # running now
    await stub.Abort(instance_pb2.AbortRequest(request_id="a-1"), timeout=5)
    chunks = []  # the client still reading hears why its stream ended
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    assert chunks and chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    indexes = [first.token_index] + [c.token_index for c in chunks]
    assert indexes == list(range(first.token_index, first.token_index + len(indexes)))  # no gap, no repeat
    cancelled = stub.Generate(instance_pb2.GenerateRequest(request_id="a-2", prompt_token_ids=[4] * 20,
                                                           sampling=greedy(200)), timeout=60)
    await cancelled.read()
    cancelled.cancel()  # the client went away
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Abort(instance_pb2.AbortRequest(request_id="never-existed"), timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    for _ in range(50):
        status = await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)
        if status.load.num_free_blocks == baseline and status.load.num_running == 0:
            break
        await asyncio.sleep(0.1)
    assert status.load.num_free_blocks == baseline
    assert status.load.num_running == 0 and status.load.num_waiting == 0


async def test_status_reports_the_step_medians_plain_and_token_weighted(stub):
    await collect(stub, instance_pb2.GenerateRequest(request_id="w-1", prompt_token_ids=[1, 2, 3], sampling=greedy(4)))
    load = (await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load
    assert load.num_steps > 0 and load.step_time_ms_p50 > 0 and load.step_time_ms_token_weighted_p50 > 0


async def test_status_reports_identity_and_geometry(stub):
    status = await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)
    assert status.instance_id == "it-0"
    assert status.role == common_pb2.ROLE_BOTH
    assert status.kv.num_blocks == NUM_BLOCKS and status.kv.block_size == 4
    assert status.load.num_total_blocks == NUM_BLOCKS
    assert status.load.freeness == pytest.approx(NUM_BLOCKS)  # (free - 0) / (0 running + 1)


async def test_registers_and_reregisters_after_losing_its_lease(instance, etcd):
    async with Registry([etcd.endpoint], "it", ttl_s=LEASE_TTL_S) as registry:
        view = await registry.watch("instances", resync_interval_s=0.5)
        record = view.get("it-0")
        assert record is not None and record["address"] == instance.address
        assert record["kv"]["num_blocks"] == NUM_BLOCKS
        etcd.pause()  # etcd unreachable for longer than the TTL: the lease expires
        await asyncio.sleep(LEASE_TTL_S * 2 + 1)
        etcd.resume()
        for _ in range(100):
            await asyncio.sleep(0.2)
            if view.get("it-0") is not None and view.staleness_s < 1:
                break
        assert json.loads(json.dumps(view.get("it-0")))["address"] == instance.address
    assert instance.is_alive()
    async with grpc.aio.insecure_channel(instance.address) as channel:
        stub = instance_pb2_grpc.InstanceServiceStub(channel)
        chunks = await collect(stub, instance_pb2.GenerateRequest(request_id="after-lease", prompt_token_ids=[1, 2, 3],
                                                                  sampling=greedy(3)))
        assert sum(len(c.token_ids) for c in chunks) == 3


async def test_migrate_out_without_a_transfer_service_names_the_flag(stub):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.MigrateOut(instance_pb2.MigrateOutRequest(request_id="any", dst_instance_id="other",
                                                             dst_address="127.0.0.1:1"), timeout=5)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--transfer-address" in error.value.details()


async def test_metrics_endpoint_reports_load(stub, metrics_port):
    await collect(stub, instance_pb2.GenerateRequest(request_id="m-1", prompt_token_ids=[1, 2, 3], sampling=greedy(2)))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
            text = await response.text()
    assert f'ferry_instance_total_blocks{{instance_id="it-0"}} {float(NUM_BLOCKS)}' in text
    assert 'ferry_instance_requests_served_total{instance_id="it-0"}' in text
    assert 'ferry_instance_grammar_dead_ends_total{instance_id="it-0"}' in text
    assert 'ferry_instance_free_slots{instance_id="it-0"}' in text


async def scrape(metrics_port: int, name: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
            text = await response.text()
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


async def test_preemptions_are_counted_and_preempted_requests_keep_their_tokens(stub, metrics_port, tiny_model_dir):
    """Four requests of 100 tokens need 4 x 26 blocks of 4 tokens; the cache has 64, so some wait preempted."""
    before = await scrape(metrics_port, "ferry_instance_preemptions_total")
    prompts = [[11 + i, 12, 13, 14] for i in range(4)]
    runs = await asyncio.gather(*(
        collect(stub, instance_pb2.GenerateRequest(request_id=f"pre-{i}", prompt_token_ids=p, sampling=greedy(100)))
        for i, p in enumerate(prompts)))
    for prompt, chunks in zip(prompts, runs):
        assert [t for chunk in chunks for t in chunk.token_ids] == reference_tokens(tiny_model_dir, prompt, 100)
    assert await scrape(metrics_port, "ferry_instance_preemptions_total") > before


async def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_tokens(stub, metrics_port,
                                                                                     tiny_model_dir):
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # two full blocks of 4 and one token
    runs, first_starts = [], []
    for i in range(2):
        chunks = await collect(stub, instance_pb2.GenerateRequest(request_id=f"pc-{i}", prompt_token_ids=prompt,
                                                                  sampling=greedy(6)))
        runs.append([t for chunk in chunks for t in chunk.token_ids])
        first_starts.append({chunk.first_start for chunk in chunks if chunk.HasField("first_start")})
    assert runs[0] == runs[1] == reference_tokens(tiny_model_dir, prompt, 6)
    assert first_starts == [{0}, {8}]  # where each computed its prompt from (a resume sends it back)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
            text = await response.text()
    hits = next(line for line in text.splitlines() if line.startswith("ferry_instance_prefix_cache_hit_tokens_total"))
    assert float(hits.split()[-1]) >= 8, hits
    load = (await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load  # what the manager is sent
    assert load.prefix_cache_hit_tokens >= 8 and load.prefix_cache_queried_tokens >= 2 * len(prompt)
