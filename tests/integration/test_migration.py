"""Live migration between two real instance processes, each with its co-located transfer service.

A client reads a request's Generate stream on A, the test asks A to MigrateOut to B, and the
client follows the hand-off with Attach on B: the concatenated tokens must equal the
never-migrated reference, with no gap and no duplicate token index. Every failure path must
leave the request running on A to its correct end, with no KV block leaked on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field, replace

import grpc
import llguidance
import numpy as np
import pytest
import torch

from services.cluster.processes import ServiceProcess, stop_all
from services.common.errors import error_from_rpc
from services.common.etcd_launcher import free_port
from services.common.prefix_hash import next_block_hash
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc, transfer_pb2
from services.common.registry import Registry
from services.common.pick_announcement import pick_from_metadata
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams
from services.transfer.client import TransferClient
from services.transfer.convert import geometry_from_record
from tests.integration.paced_steps import pace

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS = 256
BLOCK_SIZE = 4
MAX_MODEL_LEN = 1024
STAGE_BLOCKS = 4  # small, so a request of a few dozen tokens already migrates in several stages
RESERVATION_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 2.5
RPC_TIMEOUT_S = 2.0  # the reservation must outlast a copy and the commit after it (the config refuses less)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 8, 64, 2, 11, 19, 23, 29, 37, 41, 43, 47, 53]
# While a test paces an instance (Cluster.paced), its steps take at least this long: a request with 500 tokens
# to go then runs on for 25 s at least, longer than any move that keeps to this module's deadlines, however busy
# the machine. Outside those moves, requests decode at full speed (1000 tokens in about 2 s on a quiet machine).
PACE_MS = 50


def _transfer(name: str, etcd, cluster: str, log_dir, metrics_port: int = 0) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, "transfer",
                          ["--port", str(port), "--transfer-id", name, "--etcd-endpoints", etcd.endpoint,
                           "--cluster", cluster, "--num-threads", "1", "--metrics-port", str(metrics_port),
                           "--in-place-min-kib", "1"],  # gloo moves the tiny model's block runs in place
                          f"127.0.0.1:{port}", log_dir).start()


def _pace_file(log_dir, instance_id: str) -> pathlib.Path:
    return pathlib.Path(log_dir) / f"{instance_id}.pace"


def _instance(instance_id: str, transfer_address: str, etcd, cluster: str, log_dir,
              extra: tuple[str, ...] = ()) -> ServiceProcess:
    port = free_port()
    paced_steps = [sys.executable, "-m", "tests.integration.paced_steps", str(_pace_file(log_dir, instance_id))]
    return ServiceProcess(
        instance_id, "instance",
        ["--model", str(_instance.model_dir), "--port", str(port), "--instance-id", instance_id, "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", cluster, "--num-blocks", str(NUM_BLOCKS),
         "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
         "--transfer-address", transfer_address, "--migration-stage-blocks", str(STAGE_BLOCKS),
         "--migration-max-stages", "3", "--migration-reservation-timeout-s", str(RESERVATION_TIMEOUT_S),
         "--migration-transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--migration-rpc-timeout-s", str(RPC_TIMEOUT_S),
         "--verify-transfer-checksum",
         "--max-concurrent-migrations", "2", *extra],  # one more for the test that fills b with a reservation
        f"127.0.0.1:{port}", log_dir, prefix=paced_steps).start()


@dataclass
class Cluster:
    name: str
    processes: dict[str, ServiceProcess]
    log_dir: object
    metrics_ports: dict[str, int]  # of the transfer services

    def address(self, name: str) -> str:
        return self.processes[name].address

    def paced(self, *instance_ids: str) -> contextlib.AbstractContextManager[None]:
        """Inside: the instances' steps take PACE_MS at least (a migration's source, so that its request
        cannot end before the move, which takes it at a step boundary)."""
        return pace([_pace_file(self.log_dir, instance_id) for instance_id in instance_ids], PACE_MS)


@pytest.fixture(scope="module")
def cluster(etcd, tiny_model_dir, tmp_path_factory):
    name = f"mig-{uuid.uuid4().hex[:6]}"
    log_dir = tmp_path_factory.mktemp("migration-logs")
    _instance.model_dir = tiny_model_dir
    processes: dict[str, ServiceProcess] = {}
    metrics_ports = {"ta": free_port(), "tb": free_port()}
    try:
        for transfer in ("ta", "tb"):
            processes[transfer] = _transfer(transfer, etcd, name, log_dir, metrics_ports[transfer])
        for transfer in ("ta", "tb"):
            asyncio.run(processes[transfer].wait_healthy(60))
        processes["a"] = _instance("a", processes["ta"].address, etcd, name, log_dir)
        processes["b"] = _instance("b", processes["tb"].address, etcd, name, log_dir)
        for instance in ("a", "b"):
            asyncio.run(processes[instance].wait_healthy(90))
        cluster = Cluster(name, processes, log_dir, metrics_ports)
        asyncio.run(_warm_up(cluster))
        yield cluster
    finally:
        for process in processes.values():
            process.signal(signal.SIGCONT)
        stop_all(processes.values())


async def _warm_up(cluster: Cluster) -> None:
    """One migration each way, so the tests do not pay for opening channels (instance to instance,
    transfer service to transfer service) while their request races to its end."""
    wire, _ = greedy(1000)
    async with grpc.aio.insecure_channel(cluster.address("a")) as a, grpc.aio.insecure_channel(cluster.address("b")) as b:
        stubs = {"a": instance_pb2_grpc.InstanceServiceStub(a), "b": instance_pb2_grpc.InstanceServiceStub(b)}
        for src, dst in (("a", "b"), ("b", "a")):
            call = generate(stubs[src], f"warm-{src}", wire, prompt=[t + 1 for t in PROMPT])  # nothing to cache
            await call.read()
            try:
                await migrate_out(stubs[src], f"warm-{src}", dst, cluster)
                await stubs[dst].Abort(instance_pb2.AbortRequest(request_id=f"warm-{src}"), timeout=5)
            except grpc.aio.AioRpcError:
                pass  # finished first: the channels are open all the same
            call.cancel()
        await assert_all_blocks_free(stubs)


@pytest.fixture
async def stubs(cluster):
    async with grpc.aio.insecure_channel(cluster.address("a")) as a, grpc.aio.insecure_channel(cluster.address("b")) as b:
        yield {"a": instance_pb2_grpc.InstanceServiceStub(a), "b": instance_pb2_grpc.InstanceServiceStub(b)}


_references: dict[tuple, list[int]] = {}


def reference(model_dir, prompt: list[int], sampling: SamplingParams) -> list[int]:
    key = (tuple(prompt), sampling)
    if key not in _references:
        loaded = build_engine(EngineSpec(model_dir, kv_name=f"ferry-test-ref-{uuid.uuid4().hex[:6]}",
                                         block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN))
        try:
            _references[key] = loaded.engine.generate([prompt], sampling)[0]
        finally:
            loaded.close()
    return _references[key]


def greedy(max_tokens: int) -> tuple[common_pb2.SamplingParams, SamplingParams]:
    return (common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def seeded(max_tokens: int, seed: int = 99) -> tuple[common_pb2.SamplingParams, SamplingParams]:
    wire = common_pb2.SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=seed, max_tokens=max_tokens,
                                     ignore_eos=True)
    # The engine sees the wire's float32 values.
    return wire, SamplingParams(temperature=wire.temperature, top_p=wire.top_p, top_k=30, seed=seed,
                                max_tokens=max_tokens, ignore_eos=True)


@dataclass
class ClientStream:
    """One client's view of a request: Generate, then Attach after every hand-off."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # with sampling.logprobs: the chosen tokens' (float32)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    handoffs: list[instance_pb2.Handoff] = field(default_factory=list)

    async def read(self, call, until_tokens: int | None = None) -> instance_pb2.Handoff | None:
        """Read `call` until it ends (returns its hand-off, if any) or holds `until_tokens` tokens (returns None)."""
        while until_tokens is None or len(self.token_ids) < until_tokens:
            chunk = await call.read()
            assert chunk is not grpc.aio.EOF, "stream ended without a finish reason or hand-off"
            if chunk.HasField("handoff"):
                assert chunk.token_index == chunk.handoff.next_token_index == len(self.token_ids)
                self.handoffs.append(chunk.handoff)
                return chunk.handoff
            assert chunk.token_index == len(self.token_ids) or not chunk.token_ids, "gap or duplicate token index"
            self.token_ids += chunk.token_ids
            self.logprobs += [entry.logprob for entry in chunk.logprobs]
            if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self.finish_reason = chunk.finish_reason
                return None
        return None

    async def follow(self, call) -> None:
        """Read to the end, attaching to each hand-off's destination in turn."""
        channels = []
        try:
            while (handoff := await self.read(call)) is not None:
                channels.append(grpc.aio.insecure_channel(handoff.dst_address))
                call = instance_pb2_grpc.InstanceServiceStub(channels[-1]).Attach(
                    instance_pb2.AttachRequest(request_id=self.request_id, from_token_index=handoff.next_token_index,
                                               epoch=handoff.epoch), timeout=60)
        finally:
            for channel in channels:
                await channel.close()


def generate(stub, request_id: str, wire: common_pb2.SamplingParams, prompt=PROMPT):
    return stub.Generate(instance_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=wire),
                         timeout=60)


def migrate_out(stub, request_id: str, dst: str, cluster: Cluster, **fields):
    return stub.MigrateOut(instance_pb2.MigrateOutRequest(request_id=request_id, dst_instance_id=dst,
                                                          dst_address=cluster.address(dst), **fields), timeout=30)


async def free_blocks(stub) -> int:
    return (await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load.num_free_blocks


async def assert_all_blocks_free(stubs) -> None:
    for _ in range(50):
        loads = [(await s.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load for s in stubs.values()]
        if all(load.num_free_blocks == NUM_BLOCKS and load.num_running == 0 for load in loads):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"blocks leaked: {[(x.instance_id, x.num_free_blocks, x.num_running) for x in loads]}")


async def test_migrated_mid_stream_client_follows_the_hand_off(stubs, cluster, tiny_model_dir):
    wire, sampling = greedy(1000)
    client = ClientStream("mid-1")
    call = generate(stubs["a"], "mid-1", wire)
    await client.read(call, until_tokens=12)
    with cluster.paced("a", "b"):  # b too: it must still hold the request when asked
        migrating = migrate_out(stubs["a"], "mid-1", "b", cluster)
        # the pick and the migration's id, announced at once: what a manager whose deadline passes asks b about
        announced = pick_from_metadata(await migrating.initial_metadata())
        result = await migrating
        (held,) = (await stubs["b"].ListRequests(instance_pb2.ListRequestsRequest(), timeout=5)).requests
    assert (announced.request_id, held.request_id, held.origin) == ("mid-1", "mid-1",
                                                                   instance_pb2.REQUEST_ORIGIN_MIGRATED_IN)
    assert (held.migrated_from_instance_id, held.migration_id) == ("a", announced.migration_id)
    await client.follow(call)
    assert client.token_ids == reference(tiny_model_dir, PROMPT, sampling)
    assert client.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [(h.dst_instance_id, h.epoch) for h in client.handoffs] == [("b", 1)]
    assert result.request_id == "mid-1" and result.src_instance_id == "a" and result.dst_instance_id == "b"
    assert result.num_stages >= 2 and result.num_blocks >= 8 and result.num_bytes > 0
    assert result.backend == transfer_pb2.TRANSFER_BACKEND_GRPC and 0 < result.downtime_ms < result.duration_ms
    print(f"\nmigration mid-1: stages={result.num_stages} blocks={result.num_blocks} bytes={result.num_bytes} "
          f"duration_ms={result.duration_ms:.1f} downtime_ms={result.downtime_ms:.1f}")
    await assert_all_blocks_free(stubs)


async def test_blocks_cached_on_the_destination_are_not_sent_again(stubs, cluster, tiny_model_dir):
    """Every block full when the migration asked the destination (prompt + 40 tokens at least) is found in its
    prefix cache and never sent; what the request computes after that moves as usual (on a busy machine the
    request can run on for many blocks before the pause, so only that lower bound is fixed). When the pause
    comes with the computed tokens ending on a block boundary, every block is cached there and none is
    sent: one run in 16 or so (seen in a full run)."""
    wire, sampling = greedy(600)
    prompt = [(t * 7) % 500 + 1 for t in PROMPT] * 3  # a prompt of its own, 3 times PROMPT's length
    earlier = ClientStream("cached-0")
    await earlier.follow(generate(stubs["b"], "cached-0", wire, prompt=prompt))  # b computes and caches it all
    client = ClientStream("cached-1")
    call = generate(stubs["a"], "cached-1", wire, prompt=prompt)
    await client.read(call, until_tokens=40)
    with cluster.paced("a"):
        result = await migrate_out(stubs["a"], "cached-1", "b", cluster)
    await client.follow(call)
    assert client.token_ids == earlier.token_ids == reference(tiny_model_dir, prompt, sampling)
    num_blocks = -(-(len(prompt) + client.handoffs[0].next_token_index) // BLOCK_SIZE)
    # Full when the destination was first asked: the 40th token's KV is computed only by the next step, so at
    # least prompt + 39 tokens (with prompt + 40 on a block boundary, as here, one block fewer than + 40 gives).
    num_cached = (len(prompt) + 40 - 1) // BLOCK_SIZE
    assert 0 <= result.num_blocks <= num_blocks - num_cached
    await assert_all_blocks_free(stubs)


def _unmigrated_and_cached_bits(model_dir, prompt: list[int], sampling: SamplingParams,
                                resent: list[int]) -> tuple[list[int], list[float], int]:
    """`prompt` run alone, never migrated (its tokens and float32 logprobs), and how many leading blocks of
    `resent` (that prompt and some of its output, sent as a prompt of its own) a fresh instance computes with
    the bits the run computed them with (its prompt as a prompt, its output one token at a time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the instances run (--num-threads 1)
    loaded = [build_engine(EngineSpec(model_dir, kv_name=f"ferry-test-ref-{uuid.uuid4().hex[:6]}",
                                      block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN))
              for _ in range(2)]
    try:
        run, resend = (item.engine for item in loaded)
        run.add_request("run", prompt, sampling)
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs += run.step()
        resend.generate([resent], replace(sampling, max_tokens=1, logprobs=0))
        hashes: list[bytes] = []
        for i in range(len(resent) // BLOCK_SIZE):
            hashes.append(next_block_hash(hashes, resent[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
        blocks = [engine.block_manager.cached_blocks(hashes) for engine in (run, resend)]
        assert len(blocks[0]) == len(blocks[1]) == len(hashes)
        kv = [item.kv_cache.tensor for item in loaded]  # [layers, 2, blocks, ...]
        num_same = next((i for i, (x, y) in enumerate(zip(*blocks)) if not torch.equal(kv[0][:, :, x], kv[1][:, :, y])),
                        len(hashes))
    finally:
        for item in loaded:
            item.close()
        torch.set_num_threads(threads)
    tokens = [t for output in outputs for t in output.new_token_ids]
    logprobs = [float(np.float32(entry.logprob)) for output in outputs for entry in output.logprobs or ()]
    return tokens, logprobs, num_same


async def test_cached_blocks_with_other_bits_than_the_sources_are_copied_over(stubs, cluster, tiny_model_dir):
    """The destination holds blocks of the request's tokens computed otherwise: its prompt and first output
    tokens sent as one prompt (a chat's next turn, a resend), prefilled there, where the request decoded its
    output one token at a time. Bits differ, though the hashes are equal. Only the leading blocks whose crc32
    equals the source's stay shared; the rest are copied, so the request goes on with the bits it had: tokens
    and logprobs equal to the bit to the run never migrated (before: its later logprobs differed)."""
    wire, sampling = greedy(900)
    wire.logprobs, sampling = 1, replace(sampling, logprobs=1)
    prompt = [(t * 11) % 500 + 3 for t in PROMPT]  # a prompt of its own: nothing of it cached anywhere
    client = ClientStream("rebits-1")
    call = generate(stubs["a"], "rebits-1", wire, prompt=prompt)
    await client.read(call, until_tokens=24)
    resent = prompt + client.token_ids[:24]
    with cluster.paced("a"):
        other = ClientStream("rebits-0")
        await other.follow(generate(stubs["b"], "rebits-0", greedy(1)[0], prompt=resent))  # b caches resent's blocks
        result = await migrate_out(stubs["a"], "rebits-1", "b", cluster)
    await client.follow(call)
    tokens, logprobs, num_same = _unmigrated_and_cached_bits(tiny_model_dir, prompt, sampling, resent)
    assert client.token_ids == tokens
    assert client.logprobs == logprobs
    assert num_same < len(resent) // BLOCK_SIZE, "the prefilled blocks have the decoded ones' bits: no test"
    assert result.num_cached_at_destination == num_same
    print(f"\nmigration rebits-1: {num_same} of {len(resent) // BLOCK_SIZE} cached blocks with the source's bits, "
          f"blocks copied={result.num_blocks}")
    await assert_all_blocks_free(stubs)


async def test_a_resume_with_generate_replaces_a_migrated_request_nobody_attached_to(stubs, cluster, tiny_model_dir):
    """The source dies between the commit and the hand-off reaching the client, which then resumes the
    request by Generate (with the tokens it has) on the destination, where the committed copy waits."""
    wire, sampling = greedy(1000)
    client = ClientStream("orphan-1")
    call = generate(stubs["a"], "orphan-1", wire)
    await client.read(call, until_tokens=10)
    with cluster.paced("a"):
        await migrate_out(stubs["a"], "orphan-1", "b", cluster)
    await client.read(call)  # the hand-off, which in the failure never arrives: the client resumes instead
    resume = stubs["b"].Generate(instance_pb2.GenerateRequest(
        request_id="orphan-1", prompt_token_ids=PROMPT, sampling=wire, resume_token_ids=client.token_ids), timeout=60)
    await client.read(resume)
    assert client.token_ids == reference(tiny_model_dir, PROMPT, sampling)
    assert client.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await assert_all_blocks_free(stubs)



async def test_a_client_gone_before_reading_its_hand_off_leaves_no_copy_decoding(stubs, cluster):
    """The client leaves as its request moves, the hand-off unread: its frontend cancels the stream and
    aborts the request where it last knew it, the source, which drops the copy on the destination at once.
    Before, the Abort found nothing on the source, and the copy decoded for no client until the destination's
    watchdog dropped it (`migration_in_expired`) after --migration-reservation-timeout-s."""
    wire, _ = greedy(1000)
    client = ClientStream("unread-1")
    call = generate(stubs["a"], "unread-1", wire)
    await client.read(call, until_tokens=10)
    with cluster.paced("a", "b"):  # b too: a copy left there would still be decoding long after the watchdog's 5 s
        await migrate_out(stubs["a"], "unread-1", "b", cluster)
        call.cancel()  # the hand-off is never read (a hand-off gRPC had not sent yet drops the copy already)
        with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: dropped already
            await stubs["a"].Abort(instance_pb2.AbortRequest(request_id="unread-1"), timeout=5)
        deadline = time.monotonic() + RESERVATION_TIMEOUT_S / 2
        while "unread-1" in [r.request_id for r in (await stubs["b"].ListRequests(
                instance_pb2.ListRequestsRequest(), timeout=5)).requests]:
            assert time.monotonic() < deadline, "the copy on b still decodes for no client"
            await asyncio.sleep(0.05)
    await assert_all_blocks_free(stubs)

async def test_seeded_request_migrated_a_to_b_to_a(stubs, cluster, tiny_model_dir):
    wire, sampling = seeded(1000)
    client = ClientStream("twice-1")
    call = generate(stubs["a"], "twice-1", wire)
    await client.read(call, until_tokens=5)
    with cluster.paced("a"):
        await migrate_out(stubs["a"], "twice-1", "b", cluster,
                          selection=instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING)
    handoff = await client.read(call)
    attach = stubs["b"].Attach(instance_pb2.AttachRequest(request_id="twice-1", from_token_index=handoff.next_token_index,
                                                          epoch=handoff.epoch), timeout=60)
    await client.read(attach, until_tokens=len(client.token_ids) + 20)
    with cluster.paced("b"):
        back = await migrate_out(stubs["b"], "", "a", cluster)  # b picks: its only request
    assert back.request_id == "twice-1"
    await client.follow(attach)
    assert client.token_ids == reference(tiny_model_dir, PROMPT, sampling)
    assert [(h.dst_instance_id, h.epoch) for h in client.handoffs] == [("b", 1), ("a", 2)]
    await assert_all_blocks_free(stubs)


async def test_a_request_with_a_grammar_keeps_to_it_across_two_moves(stubs, cluster, tiny_model_dir):
    """Each destination rebuilds the grammar's state from the tokens so far: same tokens as never moved."""
    wire, sampling = seeded(600, seed=5)
    # At least 120 words (513 tokens here): still running after both moves (each made while its source is paced).
    wire.grammar = llguidance.LLMatcher.grammar_from_regex("([a-z]+ ){120,200}[a-z]+[.]")
    sampling = replace(sampling, grammar=wire.grammar)
    client = ClientStream("grammar-1")
    call = generate(stubs["a"], "grammar-1", wire)
    await client.read(call, until_tokens=4)
    with cluster.paced("a"):
        await migrate_out(stubs["a"], "grammar-1", "b", cluster)
    handoff = await client.read(call)
    call = stubs["b"].Attach(instance_pb2.AttachRequest(request_id="grammar-1", from_token_index=handoff.next_token_index,
                                                        epoch=handoff.epoch), timeout=60)
    await client.read(call, until_tokens=len(client.token_ids) + 8)
    with cluster.paced("b"):
        await migrate_out(stubs["b"], "grammar-1", "a", cluster)
    await client.follow(call)
    assert client.token_ids == reference(tiny_model_dir, PROMPT, sampling)
    assert client.finish_reason == common_pb2.FINISH_REASON_STOP  # the grammar ended it, nothing else
    assert [h.dst_instance_id for h in client.handoffs] == ["b", "a"]
    await assert_all_blocks_free(stubs)


async def instance_record(etcd, cluster: Cluster, instance_id: str) -> dict:
    async with Registry([etcd.endpoint], cluster.name) as registry:
        return await registry.get_json(f"instances/{instance_id}")


async def test_a_copy_by_a_service_the_destination_did_not_grant_writes_on_is_refused(stubs, cluster, tiny_model_dir,
                                                                                     etcd):
    """ta maps b as well (so it could copy into b's memory directly, shm), but b fences its blocks on its
    own transfer service tb: ta's copy is refused before it writes, and the request stays on a. The source
    now refuses it before asking ta (shm named for a destination another transfer service maps); the fence
    refusing such a copy in ta is test_transfer.py's
    test_a_fenced_instance_takes_writes_only_under_an_open_grant_on_the_service_that_writes (shm among them).
    (Instances that share one transfer service, as `make run` starts them, migrate over shm: e2e tests.)"""
    record = await instance_record(etcd, cluster, "b")
    assert record["transfer_address"] == cluster.address("tb") and record["transfer_id"] == "tb"
    async with TransferClient(cluster.address("ta")) as ta:
        await ta.map_instance("b", record["kv_shm_name"], geometry_from_record(record["kv"]))
        try:
            wire, sampling = greedy(600)
            prompt = [t + 7 for t in PROMPT]  # nothing of it cached on b, so there is always a block to copy
            client = ClientStream("shm-1")
            call = generate(stubs["a"], "shm-1", wire, prompt=prompt)
            await client.read(call, until_tokens=3)
            with cluster.paced("a"), pytest.raises(grpc.aio.AioRpcError) as error:
                await migrate_out(stubs["a"], "shm-1", "b", cluster, backend=transfer_pb2.TRANSFER_BACKEND_SHM)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, error.value.details()
            assert "shm backend copies only between instances whose KV memory one transfer service maps" in \
                error.value.details()
            await client.follow(call)
        finally:
            await ta.unmap_instance("b")
    assert not client.handoffs and client.token_ids == reference(tiny_model_dir, prompt, sampling)
    await assert_all_blocks_free(stubs)


async def test_gloo_backend_migrates_a_seeded_request_in_stages(stubs, cluster, tiny_model_dir):
    """Every stage over the pair's gloo channel (several connections, several chunks in flight, with
    checksums). Whether runs of consecutive blocks go in place depends on the block ids a's earlier
    requests left it; test_transfer.py checks in-place sends on blocks chosen for it."""
    wire, sampling = seeded(600, seed=7)  # 570 to go when paced: 28.5 s at least, as PACE_MS says
    client = ClientStream("gloo-1")
    call = generate(stubs["a"], "gloo-1", wire)
    await client.read(call, until_tokens=30)
    with cluster.paced("a"):
        result = await migrate_out(stubs["a"], "gloo-1", "b", cluster, backend=transfer_pb2.TRANSFER_BACKEND_GLOO)
    await client.follow(call)
    assert result.backend == transfer_pb2.TRANSFER_BACKEND_GLOO and result.num_stages >= 2
    assert client.token_ids == reference(tiny_model_dir, PROMPT, sampling)
    await assert_all_blocks_free(stubs)


async def test_attach_checks_request_and_epoch(stubs, cluster):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stubs["b"].Attach(instance_pb2.AttachRequest(request_id="nobody", epoch=1), timeout=5).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    wire, _ = greedy(1000)
    client = ClientStream("epoch-1")
    call = generate(stubs["a"], "epoch-1", wire)
    await client.read(call, until_tokens=2)
    with cluster.paced("a", "b"):  # running on b while the attaches come
        await migrate_out(stubs["a"], "epoch-1", "b", cluster)
        handoff = await client.read(call)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stubs["b"].Attach(instance_pb2.AttachRequest(request_id="epoch-1", epoch=handoff.epoch + 1),
                                    timeout=5).read()
        assert error.value.code() == grpc.StatusCode.ABORTED
        attach = stubs["b"].Attach(instance_pb2.AttachRequest(
            request_id="epoch-1", from_token_index=handoff.next_token_index, epoch=handoff.epoch), timeout=60)
        await client.read(attach, until_tokens=len(client.token_ids) + 1)
        attach.cancel()  # the client goes away: the request is aborted on b
    await assert_all_blocks_free(stubs)


async def test_destination_dead_or_full_keeps_the_request_on_the_source(stubs, cluster, tiny_model_dir):
    wire, sampling = greedy(800)
    client = ClientStream("full-1")
    call = generate(stubs["a"], "full-1", wire, prompt=PROMPT * 8)  # 160 prompt tokens: 40 blocks
    await client.read(call, until_tokens=3)
    with cluster.paced("a"):  # still running on a after both tries
        with pytest.raises(grpc.aio.AioRpcError) as error:  # a picks the request itself, and names it in the error
            await stubs["a"].MigrateOut(instance_pb2.MigrateOutRequest(
                dst_instance_id="ghost", dst_address=f"127.0.0.1:{free_port()}"), timeout=30)
        # a answers, so not UNAVAILABLE (the manager would take a for down): ABORTED, naming who did not answer
        assert error.value.code() == grpc.StatusCode.ABORTED, error.value.details()
        assert "keeps running on a" in error.value.details() and "destination instance at" in error.value.details()
        assert error_from_rpc(error.value).request_id == "full-1"
        # b full: a reservation leaves it 8 free blocks (the request holds 40); quicker than requests filling it,
        # which a loaded machine prefilled so slowly that the request had finished by then
        await stubs["b"].PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
            migration_id="hog-1", request_id="hog", src_instance_id="test",
            num_blocks=await free_blocks(stubs["b"]) - 8), timeout=5)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await migrate_out(stubs["a"], "full-1", "b", cluster)
        finally:
            await stubs["b"].AbortMigrateIn(instance_pb2.AbortMigrateInRequest(migration_id="hog-1"), timeout=5)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
        assert "blocks" in error.value.details()
    await client.follow(call)
    assert not client.handoffs and client.token_ids == reference(tiny_model_dir, PROMPT * 8, sampling)
    await assert_all_blocks_free(stubs)


async def test_a_source_with_a_full_batch_moves_its_queued_request_without_a_copy(stubs, cluster, etcd,
                                                                                  tiny_model_dir):
    """An instance with one batch slot, taken: MigrateOut naming no request moves the queued one (the
    default selection), which needs no KV copy and no pause and starts on the destination at once, rather
    than the running one, whose move would let the queued one start here only after a copy."""
    source = _instance("q", cluster.address("ta"), etcd, cluster.name, cluster.log_dir, ("--max-num-seqs", "1"))
    try:
        await source.wait_healthy(90)
        async with grpc.aio.insecure_channel(source.address) as channel:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            wire, sampling = greedy(1000)
            with cluster.paced("q"):  # the running request holds the slot until the move is done
                running = generate(stub, "q-running", wire)
                await running.read()  # it holds the only slot
                queued, client = generate(stub, "q-queued", wire, prompt=PROMPT[:12]), ClientStream("q-queued")
                for _ in range(50):
                    if (await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load.num_waiting == 1:
                        break
                    await asyncio.sleep(0.05)
                result = await stub.MigrateOut(instance_pb2.MigrateOutRequest(
                    dst_instance_id="b", dst_address=cluster.address("b")), timeout=30)
            assert (result.request_id, result.num_blocks, result.num_bytes) == ("q-queued", 0, 0)
            await client.follow(queued)
            assert [h.dst_instance_id for h in client.handoffs] == ["b"]
            assert client.token_ids == reference(tiny_model_dir, PROMPT[:12], sampling)
            running.cancel()  # it may have finished already; if not, its client leaving aborts it
    finally:
        stop_all([source])
    await assert_all_blocks_free(stubs)


async def test_a_destination_serving_shorter_sequences_than_the_request_may_reach_refuses_it_at_once(stubs):
    """A black-box run (2026-12-06): a request moved to an instance with a smaller KV cache (a shorter
    max_model_len) ended there early with finish reason length. The first Prepare says how far the request may
    go on its source; such a destination refuses before it reserves a block (the commit checks it too)."""
    baseline = await free_blocks(stubs["b"])
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stubs["b"].PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
            migration_id="long-1", request_id="long", src_instance_id="test", num_blocks=2,
            max_num_tokens=1 << 30), timeout=5)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
    assert "may reach 1073741824 tokens" in error.value.details() and "serves at most" in error.value.details()
    assert await free_blocks(stubs["b"]) == baseline


async def test_destination_transfer_service_killed_mid_copy(stubs, cluster, tiny_model_dir, etcd):
    victim = _transfer(f"tv-{uuid.uuid4().hex[:4]}", etcd, cluster.name, cluster.log_dir)
    try:
        await victim.wait_healthy(60)
        record = await instance_record(etcd, cluster, "b")
        async with TransferClient(victim.address) as tv:
            await tv.map_instance("b", record["kv_shm_name"], geometry_from_record(record["kv"]))
        wire, sampling = greedy(900)
        client = ClientStream("kill-1")
        call = generate(stubs["a"], "kill-1", wire, prompt=PROMPT * 2)
        await client.read(call, until_tokens=4)
        with cluster.paced("a"):
            victim.signal(signal.SIGSTOP)  # the first stage's copy hangs in it ...
            migration = asyncio.ensure_future(migrate_out(stubs["a"], "kill-1", "b", cluster,
                                                          dst_transfer_address=victim.address))
            await asyncio.sleep(0.7)
            assert not migration.done()
            victim.kill()  # ... until it dies mid-copy
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await migration
        assert error.value.code() == grpc.StatusCode.ABORTED, error.value.details()
        assert "keeps running on a" in error.value.details()
    finally:
        victim.signal(signal.SIGCONT)
        victim.kill()
    await client.follow(call)
    assert not client.handoffs and client.token_ids == reference(tiny_model_dir, PROMPT * 2, sampling)
    await assert_all_blocks_free(stubs)


async def test_request_finishing_before_commit_aborts_the_migration(stubs, cluster, tiny_model_dir):
    wire, sampling = greedy(150)
    client = ClientStream("done-1")
    call = generate(stubs["a"], "done-1", wire, prompt=PROMPT * 2)
    await client.read(call, until_tokens=2)
    tb = cluster.processes["tb"]
    tb.signal(signal.SIGSTOP)  # the first live stage's copy waits on b's transfer service
    try:
        migration = asyncio.ensure_future(migrate_out(stubs["a"], "done-1", "b", cluster))
        await client.follow(call)  # meanwhile the request runs to its end on a
    finally:
        tb.signal(signal.SIGCONT)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await migration
    assert error.value.code() == grpc.StatusCode.ABORTED, error.value.details()
    assert not client.handoffs and client.token_ids == reference(tiny_model_dir, PROMPT * 2, sampling)
    await assert_all_blocks_free(stubs)


async def test_a_reservation_goes_once_its_source_leaves_etcd_though_it_kept_growing(stubs, cluster, etcd):
    """A live source's Prepare calls keep pushing the timeout back; a source gone from etcd makes none,
    yet its reservation (and the destination's migration slot) must not wait out the timeout. Here the
    fake source keeps growing its reservation after it left, so only its absence can free it."""
    baseline = await free_blocks(stubs["b"])

    def prepare(grow_only: bool) -> instance_pb2.PrepareMigrateInRequest:
        return instance_pb2.PrepareMigrateInRequest(migration_id="ghost-1", request_id="ghost",
                                                    src_instance_id="ghost", num_blocks=4, grow_only=grow_only)
    async with Registry([etcd.endpoint], cluster.name, ttl_s=2.0) as ghost:
        await ghost.register("instances", "ghost", {"address": "127.0.0.1:9", "host": "elsewhere", "pid": 1})
        assert len((await stubs["b"].PrepareMigrateIn(prepare(False), timeout=5)).block_ids) == 4
        for _ in range(8):  # copying for 2 s while registered: b's view of etcd shows the ghost meanwhile
            await stubs["b"].PrepareMigrateIn(prepare(True), timeout=5)
            await asyncio.sleep(0.25)
        assert await free_blocks(stubs["b"]) == baseline - 4
    with pytest.raises(grpc.aio.AioRpcError) as error:
        for _ in range(100):
            await stubs["b"].PrepareMigrateIn(prepare(True), timeout=5)  # pushes the timeout back, as copying would
            await asyncio.sleep(RESERVATION_TIMEOUT_S / 6)
    assert error.value.code() == grpc.StatusCode.ABORTED, error.value.details()
    for _ in range(100):  # the blocks go once tb confirmed that no copy can write into them any more
        if await free_blocks(stubs["b"]) == baseline:
            break
        await asyncio.sleep(0.1)
    assert await free_blocks(stubs["b"]) == baseline


async def test_given_up_blocks_stay_out_of_use_while_the_transfer_service_that_writes_them_is_frozen(stubs, cluster):
    """b's transfer service writes every block that arrives for b. Frozen, it may still hold a copy
    it will finish when it resumes, so blocks b gives up meanwhile must not go to another request
    until it answers the revoke of their write grant."""
    baseline = await free_blocks(stubs["b"])
    reply = await stubs["b"].PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
        migration_id="fence-1", request_id="fence", src_instance_id="vanished", num_blocks=6), timeout=5)
    assert reply.write_grant != 0
    async with TransferClient(cluster.address("tb")) as tb:
        assert (await tb.get_status()).num_write_grants >= 1
        cluster.processes["tb"].signal(signal.SIGSTOP)
        try:
            aborted = await stubs["b"].AbortMigrateIn(instance_pb2.AbortMigrateInRequest(migration_id="fence-1"),
                                                      timeout=10)
            assert aborted.was_reserved
            await asyncio.sleep(1.5)  # watchdog sweeps ask tb again, and get no answer
            assert await free_blocks(stubs["b"]) == baseline - 6
        finally:
            cluster.processes["tb"].signal(signal.SIGCONT)
        for _ in range(100):
            if await free_blocks(stubs["b"]) == baseline:
                break
            await asyncio.sleep(0.1)
        assert await free_blocks(stubs["b"]) == baseline
        assert not await tb.revoke_writes("b", reply.write_grant)  # closed and forgotten


async def test_a_commit_taken_up_after_its_callers_wall_clock_deadline_is_refused(stubs, cluster):
    """A destination frozen while a commit waited reads it on thawing, when gRPC's relative deadline starts
    afresh; its source gave up long before and resumed the request. Before, the destination adopted it: a
    copy decoding for no client (a black-box PD fault run). The caller's wall-clock deadline now decides."""
    baseline = await free_blocks(stubs["b"])
    await stubs["b"].PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
        migration_id="late-1", request_id="late", src_instance_id="vanished", num_blocks=2), timeout=5)
    state = instance_pb2.RequestState(request_id="late", prompt_token_ids=[5, 17, 42, 99, 7], output_token_ids=[3],
                                      sampling=common_pb2.SamplingParams(max_tokens=50, ignore_eos=True), seed=1,
                                      epoch=1, num_computed_tokens=5)
    commit = instance_pb2.CommitMigrateInRequest(migration_id="late-1", state=state,
                                                 deadline_unix_ms=int((time.time() + 0.5) * 1000))
    cluster.processes["b"].signal(signal.SIGSTOP)
    try:
        sent = asyncio.ensure_future(stubs["b"].CommitMigrateIn(commit, timeout=30))  # gRPC's own deadline: far
        await asyncio.sleep(1.5)
    finally:
        cluster.processes["b"].signal(signal.SIGCONT)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await sent
    assert error.value.code() == grpc.StatusCode.ABORTED and "after its caller's deadline" in error.value.details()
    listed = await stubs["b"].ListRequests(instance_pb2.ListRequestsRequest(), timeout=5)
    assert "late" not in [r.request_id for r in listed.requests]
    for _ in range(100):  # freed at once, once the transfer service confirmed the revoke
        if await free_blocks(stubs["b"]) == baseline:
            break
        await asyncio.sleep(0.1)
    assert await free_blocks(stubs["b"]) == baseline


async def test_watchdog_frees_a_reservation_nobody_commits(stubs):
    baseline = await free_blocks(stubs["b"])
    reply = await stubs["b"].PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
        migration_id="orphan-1", request_id="orphan", src_instance_id="vanished", num_blocks=10), timeout=5)
    assert len(reply.block_ids) == 10 and reply.dst_transfer_id == "tb"
    assert await free_blocks(stubs["b"]) == baseline - 10
    await asyncio.sleep(RESERVATION_TIMEOUT_S)
    for _ in range(100):  # the watchdog looks every 0.75 s; a loaded machine may run it late
        if await free_blocks(stubs["b"]) == baseline:
            break
        await asyncio.sleep(0.1)
    assert await free_blocks(stubs["b"]) == baseline
    reply = await stubs["b"].AbortMigrateIn(instance_pb2.AbortMigrateInRequest(migration_id="orphan-1"), timeout=5)
    assert not reply.was_reserved
