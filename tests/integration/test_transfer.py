"""Transfer services end to end: real processes, a real etcd, KV caches in real shared memory.

Two services: A maps the source instances (and, for SHM, the destination ones too), B
maps the destination instances. The test process creates every KvCache with random
contents, asks A to Transfer, and compares tensors bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import uuid

import grpc
import pytest
import torch

from services.cluster.processes import ServiceProcess, stop_all
from services.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, transfer_pb2, transfer_pb2_grpc
from services.common.grpc_server import insecure_channel
from services.common.registry import Registry
from services.instance.engine.cuda_ipc import CudaIpcHandle
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.transfer.client import TransferClient
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from tests.integration.metrics_scrape import sample_value, samples

pytestmark = pytest.mark.timeout(120)

STAGING_KIB = 3
# 2 KiB blocks: whole blocks travel, one per 3 KiB chunk.
SMALL = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=24, dtype=torch.float16)
# 4 KiB blocks (1 KiB rows): bigger than the staging buffer, so each block is split by rows.
WIDE = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=16, block_size=8, num_blocks=16, dtype=torch.bfloat16)
# 128 MiB for the kill test, more than socket buffers and flow-control windows; its 2 KiB rows
# travel one per chunk through A's 3 KiB staging, so the transfer takes long enough to interrupt.
BULK = KvGeometry(num_layers=8, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=4096, dtype=torch.float16)


def _start(name: str, etcd, cluster: str, log_dir, *extra: str) -> ServiceProcess:
    port = free_port()
    process = ServiceProcess(
        name, "transfer",
        ["--port", str(port), "--transfer-id", name, "--etcd-endpoints", etcd.endpoint, "--cluster", cluster,
         "--staging-kib", str(STAGING_KIB), "--num-threads", "1", "--lease-ttl-s", "2", *extra],
        f"127.0.0.1:{port}", log_dir)
    return process.start()


def _random_cache(instance_id: str, geometry: KvGeometry, seed: int, device: str = "cpu") -> KvCache:
    cache = KvCache.create(f"ferry-test-{instance_id}-{uuid.uuid4().hex[:6]}", geometry, torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(geometry.shape, generator=generator).to(geometry.dtype))
    return cache


@pytest.fixture(scope="module")
def cluster_name() -> str:
    return f"transfer-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def services(etcd, cluster_name, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("transfer-logs")
    processes = {name: _start(name, etcd, cluster_name, log_dir) for name in ("A", "B")}
    try:
        for process in processes.values():
            asyncio.run(process.wait_healthy(60))
        yield processes
    finally:
        stop_all(processes.values())


@pytest.fixture(scope="module")
def caches():
    made = {"a-small": _random_cache("a-small", SMALL, 1), "b-small": _random_cache("b-small", SMALL, 2),
            "a-wide": _random_cache("a-wide", WIDE, 3), "b-wide": _random_cache("b-wide", WIDE, 4)}
    yield made
    for cache in made.values():
        cache.close()
        cache.unlink()


@pytest.fixture
async def mapped(services, caches):
    """Clients of A and B with A mapping every a-* (and, for SHM, b-*) cache and B every b-* cache."""
    async with TransferClient(services["A"].address) as a, TransferClient(services["B"].address) as b:
        for instance_id, cache in caches.items():
            await a.map_instance(instance_id, cache.name, cache.geometry, cache.ipc_handle)
            if instance_id.startswith("b-"):
                await b.map_instance(instance_id, cache.name, cache.geometry, cache.ipc_handle)
        yield a, b


def _block_sets(geometry: KvGeometry, num_blocks: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rng = random.Random(seed)
    return (tuple(rng.sample(range(geometry.num_blocks), num_blocks)),
            tuple(rng.sample(range(geometry.num_blocks), num_blocks)))


async def _transfer_and_check(a: TransferClient, caches, b_address: str, pair: str, backend: TransferBackend,
                              src_ids, dst_ids, is_checksum_verified: bool, write_grant: int = 0) -> None:
    src, dst = caches[f"a-{pair}"], caches[f"b-{pair}"]
    dst.tensor.copy_(torch.randn(dst.geometry.shape).to(dst.geometry.dtype))  # fresh garbage at the destination
    expected = dst.tensor.clone()
    for s, d in zip(src_ids, dst_ids):
        expected[:, :, d] = src.tensor[:, :, s]
    result = await a.transfer(BlockTransfer(InstanceId(f"a-{pair}"), src_ids, InstanceId(f"b-{pair}"), dst_ids,
                                            b_address, backend, is_checksum_verified, write_grant), timeout_s=30)
    assert result.num_blocks == len(src_ids) and result.backend is backend
    assert result.num_bytes == len(src_ids) * src.geometry.bytes_per_block
    assert torch.equal(dst.tensor.view(torch.uint8), expected.view(torch.uint8))


async def test_registers_address_backends_and_mapped_instances(etcd, cluster_name, services, mapped):
    async with Registry([etcd.endpoint], cluster_name) as registry:
        record = await registry.get_json("transfer/A")
    assert record["address"] == services["A"].address
    assert set(record["backends"]) == {"grpc", "gloo", "shm"}
    assert set(record["instance_ids"]) == {"a-small", "b-small", "a-wide", "b-wide"}


async def test_backends_limit_what_a_service_sends_with_not_what_it_receives(etcd, cluster_name, services, caches,
                                                                              tmp_path):
    """`--backends gloo` (README "Transfer backends"): the service sends with gloo alone, and still takes blocks a
    default service sends it on grpc. The sender picks the backend and does not know the receiver's list (a
    reservation names its transfer service, not its backends); refused, every migration from a default host into
    this one would fail. Its record and GetStatus list what it sends with."""
    only_gloo = _start("G", etcd, cluster_name, tmp_path, "--backends", "gloo", "--default-backend", "gloo")
    try:
        await only_gloo.wait_healthy(60)
        async with TransferClient(services["A"].address) as a, TransferClient(only_gloo.address) as g:
            assert [b.value for b in await g.backends()] == ["gloo"]
            await a.map_instance("a-small", caches["a-small"].name, SMALL)
            await g.map_instance("b-small", caches["b-small"].name, SMALL)
            await _transfer_and_check(a, caches, only_gloo.address, "small", TransferBackend.GRPC, (1, 2), (3, 4), True)
            await g.map_instance("b-small-src", caches["b-small"].name, SMALL)
            with pytest.raises(FailedPrecondition, match="backend grpc is not offered by transfer service 'G'"):
                await g.transfer(BlockTransfer(InstanceId("b-small-src"), (1,), InstanceId("a-small"), (2,),
                                               services["A"].address, TransferBackend.GRPC, False), timeout_s=20)
    finally:
        only_gloo.stop()


async def test_a_gpu_cache_this_service_cannot_open_is_failed_precondition(services):
    """A CUDA IPC handle of a GPU the service cannot see (here: no CUDA at all, or a made-up
    UUID) is refused with a message saying what is missing, and nothing is mapped."""
    handle = CudaIpcHandle("GPU-00000000-made-up", b"\x01" * 64, 4096, 0, b"ref", 0, b"", False, 0)
    async with TransferClient(services["B"].address) as b:
        with pytest.raises(FailedPrecondition, match="CUDA|not visible"):
            await b.map_instance("gpu-nowhere", "ferry-kv-gpu-nowhere", SMALL, handle)
        assert "gpu-nowhere" not in (await b.get_status()).instance_ids


async def test_instances_mapping_while_it_starts_are_registered(etcd, cluster_name, caches, tmp_path):
    """Instances map themselves again as soon as a restarted service answers, which can be
    before it registered in etcd: those calls succeed, and its record lists them."""
    service = _start("early", etcd, cluster_name, tmp_path)
    try:
        while True:  # a fresh channel per try: a channel's reconnect backoff would miss the window
            async with TransferClient(service.address, timeout_s=2) as client:
                try:
                    await client.map_instance("a-small", caches["a-small"].name, SMALL)
                    break
                except Unavailable:  # not listening yet
                    await asyncio.sleep(0.002)
        await service.wait_healthy(60)
        async with Registry([etcd.endpoint], cluster_name) as registry:
            record = await registry.get_json("transfer/early")
        assert record["instance_ids"] == ["a-small"]
    finally:
        service.stop()


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO, TransferBackend.SHM])
@pytest.mark.parametrize("pair", ["small", "wide"])
async def test_random_block_sets_move_bit_exactly(services, caches, mapped, backend, pair):
    a, _b = mapped
    geometry = caches[f"a-{pair}"].geometry
    for seed, num_blocks in enumerate((1, 5, geometry.num_blocks)):  # the last one: every block, reordered
        src_ids, dst_ids = _block_sets(geometry, num_blocks, seed)
        await _transfer_and_check(a, caches, services["B"].address, pair, backend, src_ids, dst_ids,
                                  is_checksum_verified=seed % 2 == 0)


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO])
async def test_contiguous_runs_and_checksums(services, caches, mapped, backend):
    a, _b = mapped
    src_ids, dst_ids = (3, 4, 5, 6, 0, 1, 20), (10, 11, 12, 13, 2, 7, 8)
    await _transfer_and_check(a, caches, services["B"].address, "small", backend, src_ids, dst_ids, True)


async def test_unknown_destination_is_not_found_and_the_channel_recovers(services, caches, mapped):
    a, _b = mapped
    for backend in (TransferBackend.GRPC, TransferBackend.GLOO):
        with pytest.raises(NotFound, match="not mapped"):
            await a.transfer(BlockTransfer(InstanceId("a-small"), (1,), InstanceId("nobody"), (1,),
                                           services["B"].address, backend, False), timeout_s=20)
        await _transfer_and_check(a, caches, services["B"].address, "small", backend, (2, 3), (4, 5), False)


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO, TransferBackend.SHM])
async def test_a_fenced_instance_takes_writes_only_under_an_open_grant_on_the_service_that_writes(
        services, caches, backend):
    """The service that writes into the destination (B, or A itself for shm) checks the grant: a write under
    a revoked or never-opened grant, or under none once the instance opened one, changes nothing."""
    dst = KvCache.create(f"ferry-test-b-grant-{uuid.uuid4().hex[:6]}", SMALL)
    dst_id = f"b-grant-{backend.value}"  # a failure in one backend's run leaves no fence for the next
    grant = {TransferBackend.GRPC: 101, TransferBackend.GLOO: 102, TransferBackend.SHM: 2**64 - 1}[backend]
    try:
        async with TransferClient(services["A"].address) as a, TransferClient(services["B"].address) as b:
            writer = a if backend is TransferBackend.SHM else b
            await a.map_instance("a-small", caches["a-small"].name, SMALL)
            await writer.map_instance(dst_id, dst.name, SMALL)

            async def write(grant_id: int) -> None:
                await a.transfer(BlockTransfer(InstanceId("a-small"), (5, 6), InstanceId(dst_id), (3, 4),
                                               services["B"].address, backend, True, grant_id), timeout_s=20)
            await write(0)  # no grant opened yet: unfenced
            await writer.grant_writes(dst_id, grant)
            await write(grant)
            assert torch.equal(dst.tensor[:, :, 3:5], caches["a-small"].tensor[:, :, 5:7])
            assert (await writer.get_status()).num_write_grants == 1
            assert await writer.revoke_writes(dst_id, grant)
            assert (await writer.get_status()).num_write_grants == 0
            dst.tensor.zero_()
            for closed, reason in ((grant, "not open"), (12345, "not open"), (0, "fences its KV")):
                with pytest.raises(FailedPrecondition, match=reason):
                    await write(closed)
            assert not dst.tensor.view(torch.int16).any()
            assert not await writer.revoke_writes(dst_id, grant)  # forgotten: as safe
            with pytest.raises(NotFound, match="not mapped"):
                await writer.grant_writes("nobody", grant)
            with pytest.raises(InvalidArgument, match="write_grant"):
                await writer.grant_writes(dst_id, 0)
            await writer.unmap_instance(dst_id)
    finally:
        dst.close()
        dst.unlink()


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO])
async def test_a_restarted_instance_does_not_inherit_its_previous_incarnations_grants(services, caches, backend):
    """Instance ids outlive restarts (the default is <host>-<port>). The old incarnation granted writes and
    died before it could revoke them; the new one maps fresh KV under the same id. A source still migrating
    into the old one must not write into the new one's blocks. (Found by a review of the fence.)"""
    old = KvCache.create(f"ferry-test-old-{uuid.uuid4().hex[:6]}", SMALL)
    new = KvCache.create(f"ferry-test-new-{uuid.uuid4().hex[:6]}", SMALL)
    grant = 777000 + (backend is TransferBackend.GLOO)
    try:
        async with TransferClient(services["A"].address) as a, TransferClient(services["B"].address) as b:
            await a.map_instance("a-small", caches["a-small"].name, SMALL)
            await b.map_instance("b-restart", old.name, SMALL)
            await b.grant_writes("b-restart", grant)
            await b.map_instance("b-restart", new.name, SMALL)  # the new incarnation
            new.tensor.fill_(1.0)  # blocks its requests use
            before = new.tensor.clone()
            with pytest.raises(FailedPrecondition):
                await a.transfer(BlockTransfer(InstanceId("a-small"), (1, 2), InstanceId("b-restart"), (3, 4),
                                               services["B"].address, backend, False, grant), timeout_s=20)
            assert torch.equal(new.tensor.view(torch.uint8), before.view(torch.uint8))
            await b.unmap_instance("b-restart")
    finally:
        for cache in (old, new):
            cache.close()
            cache.unlink()


async def test_gloo_senders_and_receivers_with_other_channel_settings_agree(
        etcd, cluster_name, services, caches, mapped, tmp_path):
    """The sender's --gloo-connections set the channel; each side keeps as many chunks in
    flight as its own --staging-buffers allow. Any mix moves the blocks bit for bit."""
    _a, b = mapped
    sender = _start("C-serial", etcd, cluster_name, tmp_path, "--gloo-connections", "3", "--staging-buffers", "2")
    try:
        await sender.wait_healthy(60)
        async with TransferClient(sender.address) as c:
            await c.map_instance("a-small", caches["a-small"].name, SMALL)
            for seed in range(2):
                src_ids, dst_ids = _block_sets(SMALL, SMALL.num_blocks, seed)  # 24 chunks of one block
                await _transfer_and_check(c, caches, services["B"].address, "small", TransferBackend.GLOO,
                                          src_ids, dst_ids, is_checksum_verified=True)
    finally:
        sender.stop()


# (src ids, dst ids) with runs on both sides, on one side only, and none: SMALL and WIDE ids.
IN_PLACE_LAYOUTS = (
    ((3, 4, 5, 6, 7, 8, 9, 10), (7, 8, 9, 10, 11, 12, 13, 14)),  # both sides: spans of 6 and 2 (3 KiB a row)
    ((3, 4, 5, 6), (15, 2, 9, 14)),  # the source's side only
    ((15, 2, 9, 14), (3, 4, 5, 6)),  # the destination's side only
    ((0, 1, 2, 9, 7, 12, 13), (5, 6, 7, 1, 0, 10, 11)),  # spans between staged blocks
)


async def test_gloo_moves_runs_in_place_and_stages_the_rest_bit_exactly(etcd, cluster_name, caches, tmp_path):
    """A sender with a low --in-place-min-kib sends runs of consecutive blocks row by row
    straight from KV memory; the receiver takes rows consecutive on its side straight into
    its KV memory and stages the others. Every layout lands bit for bit, and the metrics
    show bytes moved in place on both sides."""
    metrics_ports = {"D-in-place": free_port(), "E-in-place": free_port()}
    processes = {name: _start(name, etcd, cluster_name, tmp_path, "--in-place-min-kib", "1", "--metrics-port",
                              str(port)) for name, port in metrics_ports.items()}
    try:
        for process in processes.values():
            await process.wait_healthy(60)
        before = samples(metrics_ports["D-in-place"])  # every series at zero before the first transfer
        assert before['ferry_transfer_transfers_total{backend="gloo",outcome="failed"}'] == 0
        assert before['ferry_transfer_bytes_total{backend="grpc"}'] == 0
        assert before['ferry_transfer_in_place_bytes_total{side="sent"}'] == 0
        receiver = processes["E-in-place"].address
        async with TransferClient(processes["D-in-place"].address) as d, TransferClient(receiver) as e:
            for pair, geometry in (("small", SMALL), ("wide", WIDE)):
                await d.map_instance(f"a-{pair}", caches[f"a-{pair}"].name, geometry)
                await e.map_instance(f"b-{pair}", caches[f"b-{pair}"].name, geometry)
            for pair in ("small", "wide"):
                for i, (src_ids, dst_ids) in enumerate(IN_PLACE_LAYOUTS):
                    await _transfer_and_check(d, caches, receiver, pair, TransferBackend.GLOO, src_ids, dst_ids,
                                              is_checksum_verified=i % 2 == 0)
        sent = sample_value(metrics_ports["D-in-place"], 'ferry_transfer_in_place_bytes_total{side="sent"}')
        received = sample_value(metrics_ports["E-in-place"], 'ferry_transfer_in_place_bytes_total{side="received"}')
        # SMALL (2 KiB blocks): 8 + 4 + 0 + 5 blocks sent in place, 8 + 0 + 4 + 5 received in place.
        # WIDE (1 KiB rows, the 1 KiB minimum): every block, all 23, on both sides.
        assert sent == received == (17 * 2 + 23 * 4) * 1024
    finally:
        stop_all(processes.values())


async def test_channel_requests_out_of_range_are_invalid_argument(services):
    async with insecure_channel(services["B"].address) as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.OpenChannel(transfer_pb2.OpenChannelRequest(
                peer_transfer_id="x", store_address="127.0.0.1:1", rank=1, backend=transfer_pb2.TRANSFER_BACKEND_GLOO,
                num_connections=99), timeout=10)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "num_connections" in raised.value.details()
        header = transfer_pb2.BlocksHeader(dst_instance_id="b-small", dst_block_ids=[1], blocks_per_chunk=1,
                                           rows_per_chunk=1, src_transfer_id="x")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ExpectBlocks(transfer_pb2.ExpectBlocksRequest(
                header=header, backend=transfer_pb2.TRANSFER_BACKEND_GLOO, tag=2**31 - 1), timeout=10)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "tag" in raised.value.details()
        header.kv.CopyFrom(common_pb2.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8,
                                                 num_blocks=24, dtype="float16"))
        header.in_place_spans.extend([0])  # not a [start, stop) pair
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ExpectBlocks(transfer_pb2.ExpectBlocksRequest(
                header=header, backend=transfer_pb2.TRANSFER_BACKEND_GLOO, tag=64), timeout=10)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "in_place_spans" in raised.value.details()


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO])
async def test_more_transfers_to_itself_than_staging_slots_all_complete(services, caches, mapped, backend):
    """One service maps both instances (the usual one-per-host setup) and moves blocks between
    them, several transfers at once (concurrent migrations): sends and receives must not wait
    on each other's staging slots (2 by default)."""
    a, _b = mapped
    src, dst = caches["a-small"], caches["b-small"]
    dst.tensor.zero_()
    moves = [((4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), (23 - 4 * i, 22 - 4 * i, 21 - 4 * i, 20 - 4 * i))
             for i in range(5)]
    await asyncio.wait_for(asyncio.gather(*(
        a.transfer(BlockTransfer(InstanceId("a-small"), src_ids, InstanceId("b-small"), dst_ids,
                                 services["A"].address, backend, True), timeout_s=20)
        for src_ids, dst_ids in moves)), 30)
    for src_ids, dst_ids in moves:
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(dst.tensor[:, :, d].view(torch.uint8), src.tensor[:, :, s].view(torch.uint8))


@pytest.mark.parametrize("backend, in_place", [(TransferBackend.GRPC, False), (TransferBackend.GLOO, False),
                                               (TransferBackend.GLOO, True)])
async def test_killing_the_destination_mid_transfer_is_a_clean_unavailable(
        etcd, cluster_name, services, caches, mapped, tmp_path, backend, in_place):
    """in_place: a sender whose every block travels in place (the destination then receives
    straight into its KV memory), blocked in gloo waits on the dead peer."""
    a, _b = mapped
    sender = _start("D-kill", etcd, cluster_name, tmp_path, "--in-place-min-kib", "1") if in_place else None
    victim = _start(f"victim-{backend.value}", etcd, cluster_name, tmp_path, "--staging-kib", "1024")
    src = _random_cache("a-bulk", BULK, 5)
    dst = KvCache.create(f"ferry-test-c-bulk-{uuid.uuid4().hex[:6]}", BULK)
    try:
        if sender is not None:
            await sender.wait_healthy(60)
        await victim.wait_healthy(60)
        async with TransferClient(victim.address) as c, TransferClient(
                sender.address if sender else services["A"].address) as s:
            await c.map_instance("c-bulk", dst.name, BULK)
            await s.map_instance("a-bulk", src.name, BULK)
            await s.map_instance("a-small", caches["a-small"].name, SMALL)
            ids = tuple(range(BULK.num_blocks))
            transfer = asyncio.create_task(s.transfer(
                BlockTransfer(InstanceId("a-bulk"), ids, InstanceId("c-bulk"), ids[::-1], victim.address, backend,
                              False), timeout_s=60))
            await _until_some_blocks_landed(dst, ids[-1], transfer)
            victim.signal(signal.SIGSTOP)  # freeze it with the stream in flight ...
            await asyncio.sleep(0.5)
            assert not transfer.done()
            started = time.monotonic()
            victim.kill()  # ... then kill it
            with pytest.raises(Unavailable):
                await asyncio.wait_for(transfer, 20)
            assert time.monotonic() - started < 20
            # The sender is still healthy: its staging slot came back and the next transfer to B works.
            await _transfer_and_check(s, caches, services["B"].address, "small", backend, (0, 1, 2), (5, 6, 7), True)
            await s.unmap_instance("a-bulk")
            _assert_no_unread_errors(sender or services["A"])
    finally:
        victim.kill()
        if sender is not None:
            sender.stop()
        for cache in (src, dst):
            cache.close()
            cache.unlink()


async def test_killing_the_source_mid_in_place_transfer_frees_the_receiver(etcd, cluster_name, services, caches,
                                                                            mapped, tmp_path):
    """The receiver's in-place receives fail when the sender dies; it answers, frees its slots,
    and takes the next transfers (as many at once as it has receive slots)."""
    a, _b = mapped
    # 3 KiB staging: one-block spans of 2 KiB rows, 64k messages, slow enough to interrupt.
    sender = _start("D-dies", etcd, cluster_name, tmp_path, "--in-place-min-kib", "1")
    receiver = _start("E-lives", etcd, cluster_name, tmp_path, "--staging-kib", "1024")
    src = _random_cache("a-bulk2", BULK, 6)
    dst = KvCache.create(f"ferry-test-e-bulk-{uuid.uuid4().hex[:6]}", BULK)
    try:
        await asyncio.gather(sender.wait_healthy(60), receiver.wait_healthy(60))
        async with TransferClient(sender.address) as d, TransferClient(receiver.address) as e:
            await e.map_instance("e-bulk", dst.name, BULK)
            await d.map_instance("a-bulk2", src.name, BULK)
            ids = tuple(range(BULK.num_blocks))  # consecutive on both sides: in place on both
            transfer = asyncio.create_task(d.transfer(
                BlockTransfer(InstanceId("a-bulk2"), ids, InstanceId("e-bulk"), ids, receiver.address,
                              TransferBackend.GLOO, False), timeout_s=60))
            await _until_some_blocks_landed(dst, ids[0], transfer)
            sender.signal(signal.SIGSTOP)
            await asyncio.sleep(0.3)
            assert not transfer.done()
            sender.kill()
            with pytest.raises((Unavailable, grpc.aio.AioRpcError)):  # the sender died: its RPC has no answer
                await asyncio.wait_for(transfer, 20)
            await e.map_instance("b-small", caches["b-small"].name, SMALL)
            await _transfer_and_check(a, caches, receiver.address, "small", TransferBackend.GLOO, (1, 2), (3, 4), True)
            moves = [((4 * i, 4 * i + 1), (20 - 4 * i, 21 - 4 * i)) for i in range(3)]  # more than its 2 slots
            await asyncio.wait_for(asyncio.gather(*(
                a.transfer(BlockTransfer(InstanceId("a-small"), src_ids, InstanceId("b-small"), dst_ids,
                                         receiver.address, TransferBackend.GLOO, True), timeout_s=20)
                for src_ids, dst_ids in moves)), 30)
            _assert_no_unread_errors(receiver)
    finally:
        sender.kill()
        receiver.stop()
        for cache in (src, dst):
            cache.close()
            cache.unlink()


def _assert_no_unread_errors(process: ServiceProcess) -> None:
    """Every send and receive in flight on a broken channel fails; each error must be read, or asyncio
    logs "Future exception was never retrieved" with a traceback for it (it did, one per receive)."""
    assert "never retrieved" not in process.log_path.read_text(errors="replace")


@pytest.mark.parametrize("backend", [TransferBackend.GRPC, TransferBackend.GLOO])
async def test_once_a_revoke_returns_no_block_of_a_transfer_under_way_lands(services, backend):
    """The fence: the destination revokes the grant while a slow transfer writes into its KV. The
    transfer fails, and from the moment RevokeWrites answered the destination's memory never changes."""
    grant = 4242 + (backend is TransferBackend.GLOO)  # a revoked id never opens again on the shared service
    async with _bulk_pair(services, f"a-fence-{backend.value}", "b-fence", seed=8) as (a, b, _src, dst):
        await b.grant_writes("b-fence", grant)
        ids = tuple(range(BULK.num_blocks))
        transfer = asyncio.create_task(a.transfer(
            BlockTransfer(InstanceId(f"a-fence-{backend.value}"), ids, InstanceId("b-fence"), ids[::-1],
                          services["B"].address, backend, False, grant), timeout_s=60))
        await _until_some_blocks_landed(dst, ids[-1], transfer)
        assert await b.revoke_writes("b-fence", grant, timeout_s=20)
        landed = dst.tensor.clone()
        started = time.monotonic()
        # gloo hears the receiver's reason, also when the dropped channel broke its send first; a grpc stream
        # just breaks
        with pytest.raises(Aborted if backend is TransferBackend.GLOO else (Aborted, Unavailable)):
            await asyncio.wait_for(transfer, 20)
        assert time.monotonic() - started < 5
        await asyncio.sleep(0.3)
        assert torch.equal(dst.tensor.view(torch.uint8), landed.view(torch.uint8))
        assert not bool(landed[:, :, ids[0]].view(torch.int16).any())  # cut short: the last block never came


async def test_a_refused_grpc_stream_tells_its_sender_why(services):
    """grpc's client loses the status of a call that ends while it still writes (grpc/grpc#36066), and then
    could only say that the stream broke. B takes the rest of a refused stream of up to 64 MiB, so the
    sender hears the refusal itself. (CI caught the race: a 4 KiB stream under a closed grant once failed
    as UNAVAILABLE.) A bigger rest is not taken: the sender learns it failed, at once."""
    async with _bulk_pair(services, "a-why", "b-why", seed=12) as (a, b, _src, dst):
        await b.grant_writes("b-why", 555)
        assert await b.revoke_writes("b-why", 555)

        async def write(num_blocks: int) -> None:
            ids = tuple(range(num_blocks))
            await a.transfer(BlockTransfer(InstanceId("a-why"), ids, InstanceId("b-why"), ids,
                                           services["B"].address, TransferBackend.GRPC, False, 555), timeout_s=30)
        for num_blocks in (1, 2, 64) * 20 + (256,):  # small ones often, where the race was
            with pytest.raises(FailedPrecondition, match="not open"):
                await write(num_blocks)
        started = time.monotonic()
        with pytest.raises((FailedPrecondition, Unavailable)):
            await write(BULK.num_blocks)  # 128 MiB
        assert time.monotonic() - started < 10
        assert not dst.tensor.view(torch.int16).any()


async def test_a_header_the_receiver_cannot_read_is_refused_with_its_reason(services):
    """A sender whose header this side cannot read (a newer version's dtype) hears INVALID_ARGUMENT, not a
    broken stream: the receiver takes a small rest before it answers (see the test above)."""
    header = transfer_pb2.BlocksHeader(dst_instance_id="b-small", dst_block_ids=[1], blocks_per_chunk=1,
                                       rows_per_chunk=1, src_transfer_id="x")
    header.kv.CopyFrom(common_pb2.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8,
                                             num_blocks=24, dtype="float7"))

    async def stream():
        yield transfer_pb2.ReceiveBlocksRequest(header=header)
        for _ in range(8):
            yield transfer_pb2.ReceiveBlocksRequest(data=bytes(256 << 10))
    async with insecure_channel(services["B"].address) as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ReceiveBlocks(stream(), timeout=10)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
            assert "dtype" in raised.value.details()


@pytest.mark.parametrize("refusal", ["closed_grant", "unknown_destination"])
async def test_a_refused_channel_transfer_leaves_the_others_on_the_channel_running(services, caches, refusal):
    """One gloo channel carries every transfer between A and B. B refuses one transfer (a closed write
    grant, an instance it does not map) while another is half way: the refused one fails at once,
    the other completes bit-exactly, since B takes the refused one's messages instead of dropping
    the channel. (Found by a review of the fence: the other used to fail, or before that hang.)"""
    async with _bulk_pair(services, f"a-share-{refusal}", "b-share", seed=11) as (a, b, src, dst):
        await a.map_instance("a-small", caches["a-small"].name, SMALL)
        await b.map_instance("b-small", caches["b-small"].name, SMALL)
        ids = tuple(range(512))  # 16 MiB in 2 KiB rows: seconds on this channel
        healthy = asyncio.create_task(a.transfer(
            BlockTransfer(InstanceId(f"a-share-{refusal}"), ids, InstanceId("b-share"), ids[::-1],
                          services["B"].address, TransferBackend.GLOO, False), timeout_s=90))
        await _until_some_blocks_landed(dst, ids[-1], healthy)
        refused, error = ((InstanceId("b-small"), 99999), FailedPrecondition) if refusal == "closed_grant" else (
            (InstanceId("nobody"), 0), NotFound)
        started = time.monotonic()
        with pytest.raises(error):
            await a.transfer(BlockTransfer(InstanceId("a-small"), (1, 2), refused[0], (3, 4),
                                           services["B"].address, TransferBackend.GLOO, False, refused[1]),
                             timeout_s=20)
        assert time.monotonic() - started < 10
        assert not healthy.done()
        result = await asyncio.wait_for(healthy, 90)
        assert result.num_blocks == len(ids)
        assert torch.equal(dst.tensor[:, :, list(ids[::-1])].view(torch.uint8),
                           src.tensor[:, :, list(ids)].view(torch.uint8))


@contextlib.asynccontextmanager
async def _bulk_pair(services, src_id: str, dst_id: str, seed: int):
    """A random BULK cache mapped by A as `src_id`, a zeroed one mapped by B as `dst_id`, and clients of both."""
    src = _random_cache(src_id, BULK, seed)
    dst = KvCache.create(f"ferry-test-{dst_id}-{uuid.uuid4().hex[:6]}", BULK)
    try:
        async with TransferClient(services["A"].address) as a, TransferClient(services["B"].address) as b:
            await a.map_instance(src_id, src.name, BULK)
            await b.map_instance(dst_id, dst.name, BULK)
            yield a, b, src, dst
            await b.unmap_instance(dst_id)
            await a.unmap_instance(src_id)
    finally:
        for cache in (src, dst):
            cache.close()
            cache.unlink()


async def _until_some_blocks_landed(dst: KvCache, first_dst_block: int, transfer: asyncio.Task,
                                    timeout_s: float = 30) -> None:
    """Wait until the destination (zero-filled) shows the first block sent, while the transfer runs.
    Polling that block alone (not the whole 128 MiB) sees it within a millisecond or two of landing,
    long before a fast transfer could end."""
    deadline = time.monotonic() + timeout_s
    while not bool(dst.tensor[:, :, first_dst_block].view(torch.int16).any()):
        assert not transfer.done(), "the transfer ended before any block landed"
        assert time.monotonic() < deadline, "no block landed in time"
        await asyncio.sleep(0.001)


NEEDS_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices (NCCL refuses two ranks on one GPU)")


@pytest.mark.cuda
@NEEDS_TWO_GPUS
async def test_nccl_moves_blocks_bit_exactly(etcd, cluster_name, caches, tmp_path):
    log_dir = tmp_path
    processes = [_start(name, etcd, cluster_name, log_dir, "--backends", "grpc,nccl", "--nccl-device", str(i))
                 for i, name in enumerate(("N0", "N1"))]
    try:
        for process in processes:
            await process.wait_healthy(60)
        async with TransferClient(processes[0].address) as n0, TransferClient(processes[1].address) as n1:
            await n0.map_instance("a-small", caches["a-small"].name, SMALL)
            await n1.map_instance("b-small", caches["b-small"].name, SMALL)
            src_ids, dst_ids = _block_sets(SMALL, 7, seed=11)
            await _transfer_and_check(n0, caches, processes[1].address, "small", TransferBackend.NCCL,
                                      src_ids, dst_ids, True)
    finally:
        stop_all(processes)


@pytest.fixture(scope="module")
def gpu_caches():
    """Caches on the GPU (mapped through CUDA IPC handles), and one on the host to mix with them."""
    made = {"a-gpu": _random_cache("a-gpu", WIDE, 7, "cuda"), "b-gpu": _random_cache("b-gpu", WIDE, 8, "cuda"),
            "a-mixed": _random_cache("a-mixed", SMALL, 9), "b-mixed": _random_cache("b-mixed", SMALL, 10, "cuda")}
    yield made
    for cache in made.values():
        cache.close()
        cache.unlink()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pair", ["gpu", "mixed"])
async def test_gpu_caches_move_bit_exactly_on_every_backend(etcd, cluster_name, gpu_caches, tmp_path, pair):
    """KV caches on the GPU, mapped through CUDA IPC: every backend moves random block sets bit
    for bit between two services (shm: within one), GPU to GPU and host to GPU. nccl needs a
    GPU per service (NCCL refuses two ranks on one GPU), so it runs only with two."""
    backends = [TransferBackend.GRPC, TransferBackend.GLOO, TransferBackend.SHM]
    if torch.cuda.device_count() >= 2:
        backends.append(TransferBackend.NCCL)
    processes = [_start(name, etcd, cluster_name, tmp_path, "--backends", "grpc,gloo,shm,nccl", "--nccl-device",
                        str(i % torch.cuda.device_count())) for i, name in enumerate(("G0", "G1"))]
    try:
        await asyncio.gather(*(process.wait_healthy(60) for process in processes))
        async with TransferClient(processes[0].address) as g0, TransferClient(processes[1].address) as g1:
            for instance_id, cache in gpu_caches.items():
                await g0.map_instance(instance_id, cache.name, cache.geometry, cache.ipc_handle)
                await g1.map_instance(instance_id, cache.name, cache.geometry, cache.ipc_handle)
            geometry = gpu_caches[f"a-{pair}"].geometry
            for backend in backends:
                for seed, num_blocks in enumerate((1, 5, geometry.num_blocks)):
                    src_ids, dst_ids = _block_sets(geometry, num_blocks, seed)
                    await _transfer_and_check(g0, gpu_caches, processes[1].address, pair, backend, src_ids, dst_ids,
                                              is_checksum_verified=seed % 2 == 0)
    finally:
        stop_all(processes)


async def test_a_large_transfer_to_an_unknown_destination_is_not_found(services, mapped):
    """The destination refuses after the header while the sender still writes 128 MiB: the sender
    gets that refusal (the destination reads on only a moment before it ends the call)."""
    src = _random_cache("a-bulk3", BULK, 7)
    try:
        async with TransferClient(services["A"].address) as s:
            await s.map_instance("a-bulk3", src.name, BULK)
            ids = tuple(range(BULK.num_blocks))
            with pytest.raises(NotFound, match="not mapped"):
                await s.transfer(BlockTransfer(InstanceId("a-bulk3"), ids, InstanceId("nobody"), ids,
                                               services["B"].address, TransferBackend.GRPC, False), timeout_s=60)
            await s.unmap_instance("a-bulk3")
    finally:
        src.close()
        src.unlink()
