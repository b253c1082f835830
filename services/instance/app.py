"""Wiring of one instance process: engine, runner, gRPC server, etcd registration, load reports,
live migration (its transfer service link, the source driver, the destination inbox and watchdog).

Shutdown order (STYLE.md): health NOT_SERVING → revoke the etcd lease → let running
requests finish (bounded) → server.stop(grace) → cancel background tasks and migrations →
close channels, unmap from the transfer service → stop the engine thread → free the shared
KV memory (only once that thread has ended: a process whose step still runs then ends at once, skipping
the interpreter's teardown, which torch would not survive).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog
import torch

from services.common.config import as_dict
from services.common.election import watch_leader
from services.common.error_text import error_text, typed_error_text
from services.common.gen.ferry.v1 import common_pb2, instance_pb2_grpc
from services.common.grpc_server import GrpcServer, start_grpc_server
from services.common.errors import Internal, Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.ids import default_id
from services.common.registry import DRAIN_MARKS, Registry
from services.common.signals import stop_event
from services.common.startup import StartupError
from services.instance.client import InstanceClients
from services.instance.config import EngineKind, InstanceConfig, InstanceRole
from services.instance.engine.factory import EngineSpec, LoadedEngine, build_engine
from services.instance.engine.device import resolve_device
from services.instance.engine.kv_cache import KvGeometry
from services.instance.engine.sim_model import SimLatency
from services.instance.kv_segments import reclaim_stale_segments, segment_name
from services.instance.load_reporter import load_report_loop
from services.instance.manager_client import ManagerLink
from services.instance.pd_handoff import DecodeHandoff
from services.instance.role_marks import RoleMarks
from services.instance.metrics import serve_metrics
from services.instance.migration import MigrationDriver
from services.instance.migration_domain import MigrationSettings
from services.instance.migration_in import MigrationInbox, TransferEndpoint
from services.instance.migration_slots import MigrationSlots
from services.instance.runner import EngineRunner
from services.instance.stall_watchdog import StallWatchdog
from services.instance.server import InstanceIdentity, InstanceServicer
from services.instance.transfer_link import TransferLink, connect_transfer, disconnect_transfer, transfer_mapping_loop
from services.instance.write_fence import TransferWriteFence

log = structlog.get_logger(__name__)

INSTANCE_SERVICE = "ferry.v1.InstanceService"
# The wait at exit for a step still running: within the launcher's 30 s between SIGTERM and SIGKILL
# with --shutdown-grace-s (5 s) before it, and systemd's TimeoutStopSec=60s.
ENGINE_STOP_TIMEOUT_S = 20.0


async def main(config: InstanceConfig) -> None:
    log.info("config_resolved", **as_dict(config))
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    try:
        reclaim_stale_segments()
        loaded = build_engine(engine_spec(config, kv_name=segment_name()))
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    runner = EngineRunner(loaded.engine, asyncio.get_running_loop())
    runner.start()
    try:
        await serve(config, loaded, runner)
    except BaseException as exc:
        end_engine(runner, loaded, exc)
        raise
    end_engine(runner, loaded)


def end_engine(runner: EngineRunner, loaded: LoadedEngine, error: BaseException | None = None) -> None:
    """Stop the engine thread and free the KV cache. A step still running after the wait (a long prefill on a
    slow CPU, a hung accelerator) must not meet the interpreter's teardown, where torch aborts the process
    (SIGABRT, "terminate called without an active exception"): the process ends at once instead, with the KV
    memory's name removed (the step's mapping stays valid) and the log flushed; status 1 if `error` ended main."""
    if stop_engine(runner, loaded):
        return
    if error is not None:  # run_service would have logged it; it is skipped with the teardown
        log.error("service_failed", error=typed_error_text(error))
    loaded.kv_cache.unlink()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def stop_engine(runner: EngineRunner, loaded: LoadedEngine, timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> bool:
    """Free the KV cache once the engine thread has ended; False if a step still runs then (it keeps the cache)."""
    if runner.stop(timeout_s):
        loaded.close()
        return True
    log.warning("engine_step_outlived_shutdown", timeout_s=timeout_s)
    return False


async def serve(config: InstanceConfig, loaded: LoadedEngine, runner: EngineRunner) -> None:
    servicer = InstanceServicer(runner)
    server = await start_grpc_server(config.host, config.port,
                                     [(instance_pb2_grpc.add_InstanceServiceServicer_to_server, servicer)],
                                     [INSTANCE_SERVICE], advertise_host=config.advertise_host or None,
                                     tls=config.tls)
    try:
        await serve_on(server, servicer, config, loaded, runner)
    finally:
        await server.stop(0)  # already stopped unless it failed to start serving (etcd unreachable, ...)


async def serve_on(server: GrpcServer, servicer: InstanceServicer, config: InstanceConfig, loaded: LoadedEngine,
                   runner: EngineRunner) -> None:
    await server.set_serving(False)  # until registered
    instance_id = config.instance_id or default_id(server.port)
    identity = InstanceIdentity(instance_id, server.address, config.role, config.model.name,
                                loaded.max_model_len, geometry_to_proto(loaded.kv_cache.geometry))
    servicer.identity = identity
    link = await connect_transfer(config.transfer_address, instance_id, loaded.kv_cache,
                                  config.migration_rpc_timeout_s, config.tls) if config.transfer_address else None
    peers = InstanceClients(config.migration_rpc_timeout_s, config.tls)
    wire_migration(config, servicer, runner, peers, link)
    if config.metrics_port:
        serve_metrics(config.metrics_port, config.metrics_host or config.host, runner, instance_id,
                      lambda: servicer.inbox.num_quarantined)
    registry = Registry(config.etcd_endpoints, config.cluster, config.lease_ttl_s,
                        access=config.etcd_access) if config.etcd_endpoints else None
    role_marks = RoleMarks(registry, instance_id, config.role) if registry is not None else None
    servicer.on_role_change = role_writer(registry, role_marks, lambda i: instance_record(i, loaded, link))
    stop = stop_event()
    stall = StallWatchdog(runner, config.engine_stall_timeout_s, server.set_serving,
                          is_shutting_down=lambda: not servicer.is_accepting, on_broken=stop.set)
    servicer.is_engine_stalled = lambda: stall.is_stalled or runner.is_broken  # (broken: from its first moment)
    manager: ManagerLink | None = None
    try:
        async with asyncio.TaskGroup() as tasks:
            background = [tasks.create_task(servicer.inbox.watchdog_loop()),
                          tasks.create_task(stall.watch_loop(), name="engine_stall_watch_loop")]
            if link is not None:
                on_changed = transfer_follower(servicer, registry, lambda i: instance_record(i, loaded, link))
                background.append(tasks.create_task(transfer_mapping_loop(link, instance_id, loaded.kv_cache,
                                                                          on_changed=on_changed)))
            if registry is not None:
                background.append(tasks.create_task(role_marks.write_loop(), name="role_mark_write_loop"))
                await registry.wait_until_reachable(config.etcd_wait_s, stop)
                await clear_stale_self_drain(registry, instance_id)
                await register_with_role(registry, role_marks, servicer, config.role,
                                         lambda i: instance_record(i, loaded, link))
                servicer.inbox.watch_sources(await registry.watch("instances"))
                manager = ManagerLink(await watch_leader(registry), config.migration_rpc_timeout_s, config.tls)
            wire_pd(config, servicer, runner, manager)
            background.append(tasks.create_task(servicer.handoff.handoff_loop(), name="pd_handoff_loop"))
            if registry is not None:
                background.append(tasks.create_task(
                    load_report_loop(registry, servicer, config.load_report_interval_s, config.tls)))
            await server.set_serving(True)
            log.info("instance_ready", instance_id=instance_id, address=identity.address,
                     kv_blocks=loaded.kv_cache.geometry.num_blocks,
                     transfer_address=config.transfer_address or None)
            config.print_ready(instance_id, identity.address)
            await stop.wait()
            await shutdown(config, server, servicer, runner, registry)
            for task in background:
                task.cancel()
        if runner.is_broken:
            raise Internal("the engine failed (see engine_step_failed above); exiting with a failure so that a "
                           "supervisor starts this instance again")
    finally:
        if servicer.handoff is not None:
            await servicer.handoff.close()
        if manager is not None:
            await manager.close()
        await servicer.migrations.close()
        await peers.close()
        if link is not None:
            await disconnect_transfer(link, instance_id)


async def register_with_role(registry: Registry, role_marks: RoleMarks, servicer: InstanceServicer,
                             command_line_role: InstanceRole, record: Callable[[InstanceIdentity], dict]) -> None:
    """Take the stored role back (role_marks.py) and register the instance's record with it. Under the role
    lock: a SetRole meanwhile would find no record to rewrite, and register() would write the role before it."""
    async with servicer.role_lock:
        role = await role_marks.restored_role()
        if servicer.identity.role is command_line_role:  # else a SetRole came first, and wins
            servicer.identity = replace(servicer.identity, role=role)
        await registry.register("instances", servicer.identity.instance_id, record(servicer.identity))


def transfer_follower(servicer: InstanceServicer, registry: Registry | None,
                      record: Callable[[InstanceIdentity], dict]) -> Callable[[TransferLink], Awaitable[None]]:
    """What a new life of the transfer service that advertises another address, id or backends changes here
    (transfer_link.py): the reservations handed to sources name it, migrations out pick backends by it, and the
    etcd record names it (under the role lock, as SetRole rewrites the record)."""
    async def follow(link: TransferLink) -> None:
        servicer.inbox.use_transfer(TransferEndpoint(link.peer_address, link.transfer_id))
        servicer.migrations.use_transfer_service(link.transfer_id, link.backends)
        if registry is None:
            return
        async with servicer.role_lock:
            if registry.holds("instances", servicer.identity.instance_id):  # else register() writes it
                await registry.update("instances", servicer.identity.instance_id, record(servicer.identity))
    return follow


def wire_pd(config: InstanceConfig, servicer: InstanceServicer, runner: EngineRunner,
            manager: ManagerLink | None) -> None:
    """Prefill/decode disaggregation: the hand-off pusher."""
    servicer.handoff = DecodeHandoff(servicer.identity.instance_id, runner, servicer.migrations, manager,
                                     config.pd_handoff, lambda: servicer.identity.role,
                                     num_workers=config.max_concurrent_migrations, hold_s=config.pd_handoff_hold_s)
    runner.on_prefilled = servicer.handoff.note_prefilled
    runner.holds_first_tokens = lambda: servicer.handoff.is_pushing


def role_writer(registry: Registry | None, role_marks: RoleMarks | None,
                record: Callable[[InstanceIdentity], dict]) -> Callable[[InstanceIdentity], Awaitable[None]]:
    """What SetRole does before the role changes here: rewrite the etcd record, and keep the role
    for restarts (role_marks.py)."""
    async def write(identity: InstanceIdentity) -> None:
        if registry is not None and registry.holds("instances", identity.instance_id):  # else register() writes it
            await registry.update("instances", identity.instance_id, record(identity))
        if role_marks is not None:
            await role_marks.keep(identity.role)
    return write


def wire_migration(config: InstanceConfig, servicer: InstanceServicer, runner: EngineRunner,
                   peers: InstanceClients, link: TransferLink | None) -> None:
    """Both sides of live migration, sharing --max-concurrent-migrations slots."""
    slots = MigrationSlots(config.max_concurrent_migrations)
    settings = MigrationSettings(
        instance_id=servicer.identity.instance_id, transfer_backend=config.transfer_backend.backend,
        stage_blocks=config.migration_stage_blocks, max_stages=config.migration_max_stages,
        is_checksum_verified=config.verify_transfer_checksum, rpc_timeout_s=config.migration_rpc_timeout_s,
        transfer_timeout_s=config.migration_transfer_timeout_s,
        reservation_timeout_s=config.migration_reservation_timeout_s,
        transfer_id=link.transfer_id if link else "", offered_backends=link.backends if link else ())
    servicer.migrations = MigrationDriver(runner, settings, slots, peers, link.client if link else None)
    endpoint = TransferEndpoint(link.peer_address, link.transfer_id) if link else TransferEndpoint("", "")
    fence = TransferWriteFence(link.client, servicer.identity.instance_id) if link else None
    servicer.inbox = MigrationInbox(runner, slots, config.migration_reservation_timeout_s, endpoint, fence)


async def shutdown(config: InstanceConfig, server, servicer: InstanceServicer, runner: EngineRunner,
                   registry: Registry | None) -> None:
    """SIGTERM: take nothing new; drain itself, so the leader live-migrates what runs here to other
    instances (KV and all: their clients see nothing) within --shutdown-grace-s; then leave etcd and
    cut what is left (frontends resume those elsewhere)."""
    log.info("instance_stopping", num_active=runner.num_active)
    await server.set_serving(False)
    servicer.is_accepting = False
    if registry is not None and runner.num_active:
        await drain_self(registry, servicer.identity.instance_id)
    deadline = asyncio.get_running_loop().time() + config.shutdown_grace_s
    while runner.num_active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if registry is not None:
        await registry.close()  # the record goes, and a drain mark of our own with it (same lease)
    open_streams = servicer.open_streams()
    await server.stop(grace=1.0)  # a stream may still end whole within it: its last token came at the deadline
    log.info("instance_stopped", num_cut=sum(not stream.is_finished for stream in open_streams))


async def drain_self(registry: Registry, instance_id: str) -> None:
    """A drain mark under our lease (unless an operator's is there already, checked in the same etcd transaction):
    the leader moves our requests off as for `Drain`, and the mark vanishes with the lease, so no restart comes back
    drained. A lease lost meanwhile puts it back; an operator's Undrain of it stands (the registry withdraws it)."""
    try:
        if await registry.register(DRAIN_MARKS, instance_id, {"instance_id": instance_id,
                                                              "drained_by": "shutdown", "drained_at": time.time()}):
            log.info("instance_draining_itself", instance_id=instance_id)
    except (Unavailable, *ETCD_ERRORS) as exc:  # etcd away: nothing will migrate; the grace still applies
        log.warning("self_drain_failed", instance_id=instance_id, error=error_text(exc))


async def clear_stale_self_drain(registry: Registry, instance_id: str) -> None:
    """A self-drain mark left by this instance's previous process (killed while it drained itself)
    would keep it drained until that process's lease ends: remove it. An operator's mark stays."""
    try:
        if await registry.delete_json_if(f"{DRAIN_MARKS}/{instance_id}", _is_self_drain):
            log.info("stale_self_drain_cleared", instance_id=instance_id)
    except (Unavailable, *ETCD_ERRORS) as exc:  # it still goes with the old lease, within seconds
        log.warning("stale_self_drain_not_cleared", instance_id=instance_id, error=error_text(exc))


def _is_self_drain(mark: Any) -> bool:
    return isinstance(mark, dict) and mark.get("drained_by") == "shutdown"


def engine_spec(config: InstanceConfig, kv_name: str) -> EngineSpec:
    return EngineSpec(model_dir=config.model, kv_name=kv_name, dtype=getattr(torch, config.dtype),
                      block_size=config.block_size, num_blocks=config.num_blocks, kv_cache_mib=config.kv_cache_mib,
                      max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.step_token_budget,
                      max_model_len=config.max_model_len, sim_latency=_sim_latency(config),
                      enable_prefix_caching=config.enable_prefix_caching, device=resolve_device(config.device),
                      priority_headroom_blocks=config.priority_headroom_blocks,
                      max_num_waiting=config.max_waiting_requests,
                      prefill_chunk_tokens=config.prefill_chunk_tokens)


def _sim_latency(config: InstanceConfig) -> SimLatency | None:
    if config.engine is not EngineKind.SIM:
        return None
    return SimLatency(config.sim_step_ms, config.sim_prefill_ms_per_token, config.sim_decode_ms_per_seq)


def geometry_to_proto(geometry: KvGeometry) -> common_pb2.KvGeometry:
    return common_pb2.KvGeometry(
        num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
        block_size=geometry.block_size, num_blocks=geometry.num_blocks, dtype=geometry.dtype_name)


def instance_record(identity: InstanceIdentity, loaded: LoadedEngine, link: TransferLink | None = None) -> dict:
    geometry = loaded.kv_cache.geometry
    return {
        "instance_id": identity.instance_id, "address": identity.address, "role": identity.role.value,
        "model": identity.model, "state": "serving", "pid": os.getpid(), "host": socket.gethostname(),
        "max_model_len": loaded.max_model_len, "max_num_seqs": loaded.engine.config.max_num_seqs,
        "vocab_size": loaded.engine.vocab_size, "model_fingerprint": loaded.model_fingerprint,
        "kv_window_tokens": loaded.engine.block_manager.window or 0,
        "kv_shm_name": loaded.kv_cache.name,
        "kv_device": str(loaded.kv_cache.tensor.device),
        "transfer_address": link.peer_address if link else "", "transfer_id": link.transfer_id if link else "",
        "kv": {"num_layers": geometry.num_layers, "num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim,
               "block_size": geometry.block_size, "num_blocks": geometry.num_blocks,
               "dtype": geometry.dtype_name},
    }
