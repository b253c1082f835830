"""A transfer service closes its channels and client to a peer transfer service as soon as that peer leaves
etcd or restarts, rather than after they idled for 10 minutes: real processes, a real etcd.

S (the survivor) sends to P on gloo and grpc and P sends to S on gloo, so S holds an outgoing gloo channel
and a client to P's address and an incoming gloo channel from P's id. P is then SIGKILLed and started again
under its id on a new port (its old lease expires after --lease-ttl-s), and later stopped and replaced by a
service under another id (its lease is revoked at once; S keeps the incoming channel for 2 lease TTLs in case
the same life registers again): each time S must close what it held to the old life within seconds, and
transfers to the new life must work.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.common.errors import FerryError, Unavailable
from services.transfer.client import TransferClient
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend
from tests.integration.metrics_scrape import sample_value

pytestmark = pytest.mark.timeout(180)

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=16, dtype=torch.float16)
LEASE_TTL_S = 2
LONG_LEASE_TTL_S = 30  # outlasts a pause of etcd while a peer restarts
# After a kill: the lease expires (LEASE_TTL_S), then etcd's watch tells S at once; an incoming channel whose peer
# has not come back closes 2 x LEASE_TTL_S after that. Plus 4 s for a loaded 2-core machine (two test workers and
# the processes they start): still minutes short of the 10 min idle close this tells apart.
CLOSE_WITHIN_S = 3 * LEASE_TTL_S + 4


def _start(name: str, transfer_id: str, etcd, cluster: str, log_dir, *extra: str, port: int = 0,
           lease_ttl_s: float = LEASE_TTL_S) -> ServiceProcess:
    port = port or free_port()
    args = ["--port", str(port), "--transfer-id", transfer_id, "--etcd-endpoints", etcd.endpoint, "--cluster", cluster,
            "--num-threads", "1", "--lease-ttl-s", str(lease_ttl_s), "--log-format", "json", *extra]
    return ServiceProcess(name, "transfer", args, f"127.0.0.1:{port}", log_dir).start()


def _cache(name: str, seed: int) -> KvCache:
    cache = KvCache.create(f"ferry-test-{name}-{uuid.uuid4().hex[:6]}", GEOMETRY)
    cache.tensor.copy_(torch.randn(GEOMETRY.shape, generator=torch.Generator().manual_seed(seed)).to(GEOMETRY.dtype))
    return cache


async def _ready(process: ServiceProcess, instance_id: str, cache: KvCache) -> None:
    await process.wait_healthy(60)
    async with TransferClient(process.address) as client:
        await client.map_instance(instance_id, cache.name, GEOMETRY)


async def _move(src: ServiceProcess, src_cache: KvCache, src_id: str, dst: ServiceProcess, dst_cache: KvCache,
                dst_id: str, backend: TransferBackend, timeout_s: float = 30) -> None:
    """Blocks 1, 5, 9 of src into 2, 3, 4 of dst, checked bit for bit."""
    dst_cache.tensor.copy_(torch.randn(GEOMETRY.shape).to(GEOMETRY.dtype))
    expected = dst_cache.tensor.clone()
    expected[:, :, [2, 3, 4]] = src_cache.tensor[:, :, [1, 5, 9]]
    async with TransferClient(src.address) as client:
        await client.transfer(BlockTransfer(InstanceId(src_id), (1, 5, 9), InstanceId(dst_id), (2, 3, 4), dst.address,
                                            backend, True), timeout_s=timeout_s)
    assert torch.equal(dst_cache.tensor.view(torch.uint8), expected.view(torch.uint8))


async def _both_ways(s: ServiceProcess, s_cache: KvCache, p: ServiceProcess, p_cache: KvCache) -> None:
    for backend in (TransferBackend.GLOO, TransferBackend.GRPC):
        await _move(s, s_cache, "s-kv", p, p_cache, "p-kv", backend)
    await _move(p, p_cache, "p-kv", s, s_cache, "s-kv", TransferBackend.GLOO)


def _peer_gone(process: ServiceProcess, peer_address: str) -> list[dict]:
    events = []
    for line in process.log_path.read_text(errors="replace").splitlines():
        if '"peer_gone"' in line:
            event = json.loads(line)
            if event["event"] == "peer_gone" and event["peer"] == peer_address:
                events.append(event)
    return events


async def _wait_closed(process: ServiceProcess, peer_address: str, num_channels: int, within_s: float) -> list[dict]:
    """The peer_gone events for `peer_address` once they closed `num_channels` channels (and its client)."""
    deadline = time.monotonic() + within_s
    while sum((events := _peer_gone(process, peer_address)) and [e["num_channels_closed"] for e in events]) < num_channels:
        assert time.monotonic() < deadline, f"{peer_address}: only {events} within {within_s} s"
        await asyncio.sleep(0.05)
    assert sum(e["num_channels_closed"] for e in events) == num_channels
    assert sum(e["num_clients_closed"] for e in events) == 1
    return events


async def _until(condition: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        await asyncio.sleep(0.05)


def _num_threads(process: ServiceProcess) -> int:
    return len(os.listdir(f"/proc/{process.pid}/task"))


def _num_fds(process: ServiceProcess) -> int:
    return len(os.listdir(f"/proc/{process.pid}/fd"))


def _assert_clean_log(process: ServiceProcess) -> None:
    text = process.log_path.read_text(errors="replace")
    assert "never retrieved" not in text and "Traceback" not in text and "close_failed" not in text


def _clean_up(processes: list[ServiceProcess], *caches: KvCache) -> None:
    stop_all(processes)
    for cache in caches:
        cache.close()
        cache.unlink()


async def test_a_restarted_peers_old_channels_close_at_once_and_its_new_life_takes_transfers(etcd, cluster, tmp_path):
    """Before, S kept its gloo channels (each a gloo group: threads, sockets, a store) and gRPC client to each
    old life of P until they idled 10 minutes: with peers restarting, S's threads grew run after run."""
    metrics_port = free_port()
    s = _start("S", "S", etcd, cluster, tmp_path, "--metrics-port", str(metrics_port))
    p = _start("P-1", "P", etcd, cluster, tmp_path)
    s_cache, p_cache = _cache("s-kv", 1), _cache("p-kv", 2)
    lives = [p]
    try:
        await asyncio.gather(_ready(s, "s-kv", s_cache), _ready(p, "p-kv", p_cache))
        await _both_ways(s, s_cache, p, p_cache)
        num_threads, num_fds = _num_threads(s), _num_fds(s)

        p.kill()  # its lease expires after LEASE_TTL_S; a new life takes its id on another port meanwhile
        killed = time.monotonic()
        p = _start("P-2", "P", etcd, cluster, tmp_path)
        lives.append(p)
        # Its record expired ("left": outgoing channel and client) and the new life took its id ("restarted":
        # the incoming channel too), or the new life replaced the record before it expired (all at once). A new
        # life slower to start than 2 lease TTLs (a torch import on a loaded machine) finds the incoming channel
        # closed already: its old life stayed away.
        events = await _wait_closed(s, lives[0].address, 2, CLOSE_WITHIN_S)
        assert time.monotonic() - killed < CLOSE_WITHIN_S
        assert {e["peer_transfer_id"] for e in events} == {"P"} and events[-1]["why"] in ("restarted", "stayed_away")
        # The two gloo groups (4 connections each) end on a background thread: measured 26 -> 14 threads
        # and 70 -> 17 file descriptors within 0.2 s.
        await _until(lambda: _num_threads(s) <= num_threads - 8 and _num_fds(s) <= num_fds - 30, CLOSE_WITHIN_S)
        await _ready(p, "p-kv", p_cache)
        await _both_ways(s, s_cache, p, p_cache)  # fresh channels to the new life

        p.stop()  # graceful: its lease is revoked as it stops, so S hears at once
        events = await _wait_closed(s, lives[1].address, 2, 2 * LEASE_TTL_S + CLOSE_WITHIN_S)
        # Outgoing channel and client at once; the incoming one once it stayed away 2 x its lease TTL.
        assert [e["why"] for e in events] == ["left", "stayed_away"]
        p = _start("Q", "Q", etcd, cluster, tmp_path)
        lives.append(p)
        await _ready(p, "p-kv", p_cache)
        await _both_ways(s, s_cache, p, p_cache)

        assert sample_value(metrics_port, 'ferry_transfer_peer_closes_total{what="channel"}') == 4
        assert sample_value(metrics_port, 'ferry_transfer_peer_closes_total{what="client"}') == 2
        _assert_clean_log(s)
    finally:
        _clean_up([s, *lives], s_cache, p_cache)


def _events(process: ServiceProcess, name: str) -> list[dict]:
    return [json.loads(line) for line in process.log_path.read_text(errors="replace").splitlines()
            if f'"{name}"' in line and json.loads(line)["event"] == name]


async def _mapped_before_registering(process: ServiceProcess, instance_id: str, cache: KvCache, within_s: float) -> None:
    """Map `cache` as soon as the process answers (it serves before it registers: etcd may be away)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            async with TransferClient(process.address) as client:
                await client.map_instance(instance_id, cache.name, GEOMETRY)
            return
        except FerryError:
            assert process.is_alive and time.monotonic() < deadline, f"{process.address} did not answer"
            await asyncio.sleep(0.2)


async def test_a_peer_restarted_on_its_port_keeps_the_channels_its_new_life_opened_before_it_registered(
        running_etcd, cluster, tmp_path):
    """A peer restarted on its own port answers before it registers, so channels between it and S can open before
    S hears of its new life. S's close of the old life then took those too (a channel did not know which life of
    its peer joined it): the new life's next transfer to S failed UNAVAILABLE (S had no channel from it any more),
    and S's next one to it opened one more. Each OpenChannel now says which life of each end joined it."""
    etcd, port = running_etcd, free_port()
    s = _start("S", "S", etcd, cluster, tmp_path, lease_ttl_s=LONG_LEASE_TTL_S)
    p = _start("P-1", "P", etcd, cluster, tmp_path, port=port, lease_ttl_s=LONG_LEASE_TTL_S)
    s_cache, p_cache = _cache("s-kv", 1), _cache("p-kv", 2)
    lives = [p]
    try:
        await asyncio.gather(_ready(s, "s-kv", s_cache), _ready(p, "p-kv", p_cache))
        await _both_ways(s, s_cache, p, p_cache)  # S: a gloo channel to P's address and one from P's id
        p.kill()
        etcd.pause()  # P's next life answers, but cannot register: S hears of it only once etcd is back
        try:
            p = _start("P-2", "P", etcd, cluster, tmp_path, port=port, lease_ttl_s=LONG_LEASE_TTL_S)
            lives.append(p)
            await _mapped_before_registering(p, "p-kv", p_cache, 60)
            await _move(p, p_cache, "p-kv", s, s_cache, "s-kv", TransferBackend.GLOO)  # S: a channel from P-2
            try:  # S's channel to the old life fails the first transfer; the retry opens one to P-2
                await _move(s, s_cache, "s-kv", p, p_cache, "p-kv", TransferBackend.GLOO, timeout_s=10)
            except Unavailable:
                await _move(s, s_cache, "s-kv", p, p_cache, "p-kv", TransferBackend.GLOO)
        finally:
            etcd.resume()
        await _until(lambda: any(e["why"] == "restarted" for e in _peer_gone(s, p.address)), 30)
        num_opens = len(_events(s, "channel_accepted")), len(_events(p, "channel_accepted"))
        await _move(p, p_cache, "p-kv", s, s_cache, "s-kv", TransferBackend.GLOO)  # before: UNAVAILABLE
        await _move(s, s_cache, "s-kv", p, p_cache, "p-kv", TransferBackend.GLOO)  # before: a fresh open
        assert (len(_events(s, "channel_accepted")), len(_events(p, "channel_accepted"))) == num_opens
        # The old life's channels had gone already: the outgoing one with its failed transfer, the incoming one
        # when P-2's replaced it.
        assert sum(e["num_channels_closed"] for e in _peer_gone(s, p.address)) == 0
        _assert_clean_log(s)
    finally:
        _clean_up([s, *lives], s_cache, p_cache)
