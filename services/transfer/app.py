"""Wiring of one transfer service process: mappings, staging, channels, gRPC server, etcd.

Peers: a watch of `transfer/` in etcd closes the channels and clients to a peer that left or
restarted (`peer_watch.py`).

Shutdown order (STYLE.md): health NOT_SERVING → revoke the etcd lease → server.stop(grace)
→ drop channels → close peer clients → stop worker threads → unmap KV memory.
"""

from __future__ import annotations

import asyncio
import os
import socket

import structlog
import torch

from services.common.config import as_dict
from services.common.errors import FailedPrecondition, NotFound
from services.common.grpc_server import BULK_TRANSFER_OPTIONS, GrpcServer, start_grpc_server
from services.common.heap import keep_freed_heap
from services.common.periodic import periodic_loop
from services.common.registry import Registry
from services.common.signals import stop_event
from services.transfer.metrics import serve_metrics
from services.transfer.channels import ChannelTable
from services.transfer.pair_channel import configure_nccl
from services.transfer.client import TransferClients
from services.transfer.config import TransferConfig
from services.transfer.convert import geometry_from_record
from services.transfer.domain import IDLE_CLOSE_S, InstanceId, TransferBackend, TransferId, new_incarnation
from services.transfer.kv_mappings import KvMappings
from services.transfer.peer_watch import PeerWatch
from services.transfer.receiver import BlockReceiver
from services.transfer.sender import BlockSender
from services.transfer.server import TransferNode, TransferServicer, add_transfer_servicer
from services.transfer.staging import StagingPool
from services.transfer.threads import TransferThreads

log = structlog.get_logger(__name__)

TRANSFER_SERVICE = "ferry.v1.TransferService"
VANISHED_CHECK_INTERVAL_S = 5.0  # how often mapped segments are checked for instances that died


async def main(config: TransferConfig) -> None:
    log.info("config_resolved", **as_dict(config))
    configure_nccl(os.environ)
    if config.heap_keep_mib and not keep_freed_heap(config.heap_keep_mib << 20):
        log.warning("heap_keep_unavailable", reason="no glibc mallopt here; grpc transfers fault in fresh pages")
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    if config.metrics_port:
        serve_metrics(config.metrics_port, config.metrics_host or config.host, [b.value for b in config.backends])
    servicer = TransferServicer()
    server = await start_grpc_server(config.host, config.port,
                                     [(add_transfer_servicer, servicer)],
                                     [TRANSFER_SERVICE], advertise_host=config.advertise_host or None,
                                     tls=config.tls, options=BULK_TRANSFER_OPTIONS)
    await server.set_serving(False)  # until registered
    transfer_id = TransferId(config.transfer_id or f"{socket.gethostname()}-{server.port}")
    registry = Registry(config.etcd_endpoints, config.cluster, config.lease_ttl_s,
                        access=config.etcd_access) if config.etcd_endpoints else None
    threads = TransferThreads.start(config.num_staging_slots * config.staging_buffers, nccl_staging_device(config))
    peers = TransferClients(piece_bytes=config.grpc_piece_kib * 1024, tls=config.tls,
                            idle_close_s=idle_close_s(config))
    node = build_node(config, transfer_id, server, registry, peers, threads)
    servicer.node = node
    try:
        await serve(config, node, server, registry, peers)
    finally:
        await server.stop(0)  # already stopped unless serving failed to start (etcd unreachable)
        node.channels.close()
        await peers.close()
        threads.shutdown()
        node.mappings.close()


def build_node(config: TransferConfig, transfer_id: TransferId, server: GrpcServer, registry: Registry | None,
               peers: TransferClients, threads: TransferThreads) -> TransferNode:
    mappings = KvMappings(transfer_id)
    # Separate pools for the two directions: with one pool, sends to this same service (every
    # transfer between two instances it maps) could take every slot and wait forever for
    # receives that need one.
    send_staging = StagingPool(config.num_staging_slots, config.staging_kib * 1024, config.staging_buffers)
    receive_staging = StagingPool(config.num_staging_slots, config.staging_kib * 1024, config.staging_buffers)
    nccl_device = nccl_staging_device(config)
    send_nccl_staging = receive_nccl_staging = None
    if nccl_device is not None:  # 2 x --num-staging-slots x 2 buffers of GPU memory
        send_nccl_staging = StagingPool(config.num_staging_slots, config.staging_kib * 1024, 2, nccl_device)
        receive_nccl_staging = StagingPool(config.num_staging_slots, config.staging_kib * 1024, 2, nccl_device)
    channel_host = config.advertise_host or server.advertise_host
    channels = ChannelTable(transfer_id, channel_host, config.channel_timeout_s, threads.rendezvous,
                            config.gloo_connections, config.nccl_device, idle_close_s=idle_close_s(config),
                            max_rendezvous=threads.rendezvous_threads, incarnation=new_incarnation())
    backends = tuple(config.backends)
    sender = BlockSender(transfer_id, backends, mappings, send_staging, channels, peers, threads,
                         in_place_min_row_bytes=config.in_place_min_kib * 1024, nccl_staging=send_nccl_staging)
    receiver = BlockReceiver(mappings, receive_staging, channels, threads, nccl_staging=receive_nccl_staging)

    async def on_mappings_changed() -> None:
        # Before registration (instances map themselves as soon as the server answers) the
        # record is written by register(), and once more right after it.
        if registry is not None and registry.holds("transfer", transfer_id):
            await registry.update("transfer", transfer_id, _record(node))
    node = TransferNode(transfer_id, server.address, backends, config.default_backend, config.transfer_timeout_s,
                        mappings, sender, receiver, channels, on_mappings_changed)
    return node


def idle_close_s(config: TransferConfig) -> float:
    """How long a peer's channel or client may go unused before it is closed: well above the longest transfer."""
    return max(IDLE_CLOSE_S, 4 * config.transfer_timeout_s)


def nccl_staging_device(config: TransferConfig) -> torch.device | None:
    """Where nccl chunks are staged: --nccl-device where the service offers nccl (the config checked
    that it can use that GPU), else None."""
    return torch.device("cuda", config.nccl_device) if TransferBackend.NCCL in config.backends else None


async def serve(config: TransferConfig, node: TransferNode, server: GrpcServer, registry: Registry | None,
                peers: TransferClients) -> None:
    stop = stop_event()
    if registry is not None:
        await registry.wait_until_reachable(config.etcd_wait_s, stop)
        await _map_from_etcd(registry, node, config.map_instances)
        await registry.register("transfer", node.transfer_id, _record(node))
        await node.on_mappings_changed()  # instances mapped while register() wrote the record
        await watch_peers(registry, node, peers, 2 * config.lease_ttl_s)
    await server.set_serving(True)
    log.info("transfer_ready", transfer_id=node.transfer_id, address=node.address,
             backends=[b.value for b in node.backends], instance_ids=node.mappings.instance_ids())
    config.print_ready(node.transfer_id, node.address)
    sweep = asyncio.create_task(unmap_vanished_loop(node))
    await stop.wait()
    sweep.cancel()
    log.info("transfer_stopping")
    await server.set_serving(False)
    if registry is not None:
        await registry.close()
    await server.stop(grace=2.0)


async def watch_peers(registry: Registry, node: TransferNode, peers: TransferClients, incoming_grace_s: float) -> None:
    """Close the channels and clients to a peer transfer service as soon as it leaves etcd or restarts
    (`PeerWatch`; incoming channels of one that left after `incoming_grace_s`, unless it is back); the
    registry stops the view when it closes."""
    view = await registry.watch("transfer")
    view.on_change(PeerWatch(node.transfer_id, node.channels, peers, view.members, incoming_grace_s).on_change)


async def unmap_vanished_loop(node: TransferNode, interval_s: float = VANISHED_CHECK_INTERVAL_S) -> None:
    """Let go of the KV memory of instances that died without unmapping it (`KvMappings.unmap_vanished`)."""
    async def step() -> None:
        if node.mappings.unmap_vanished():
            await node.on_mappings_changed()
    await periodic_loop("unmap_vanished_loop", interval_s, step)


async def _map_from_etcd(registry: Registry, node: TransferNode, instance_ids: list[str]) -> None:
    for instance_id in instance_ids:
        record = await registry.get_json(f"instances/{instance_id}")
        if record is None or "kv_shm_name" not in record or "kv" not in record:
            raise NotFound(f"--map-instances: no usable etcd record instances/{instance_id} in cluster "
                           f"{registry.cluster!r} (needs kv_shm_name and kv); start the instance first")
        if record.get("kv_device", "cpu") != "cpu":
            raise FailedPrecondition(f"--map-instances: instance {instance_id} keeps its KV cache on "
                                     f"{record['kv_device']}, which only the instance itself can share (it maps it "
                                     "over MapInstance at startup, with --transfer-address)")
        node.mappings.map(InstanceId(instance_id), record["kv_shm_name"], geometry_from_record(record["kv"]))


def _record(node: TransferNode) -> dict:
    return {"transfer_id": node.transfer_id, "address": node.address, "backends": [b.value for b in node.backends],
            "instance_ids": node.mappings.instance_ids(), "pid": os.getpid(), "host": socket.gethostname(),
            "incarnation": node.channels.incarnation}
