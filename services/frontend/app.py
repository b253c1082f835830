"""Wiring of one frontend process: model files, etcd views, dispatcher, clients, HTTP server.

Shutdown order (STYLE.md): stop accepting (/health 503, new requests 503) → take our
`frontends/<id>` key out of etcd → give running requests --shutdown-grace-s, then end those
left with an error a client can read (in_flight.py) → stop the HTTP server → close the gRPC
channels → revoke the etcd lease. The lease and the watches live through the grace: a request
resumed then goes where the cluster is now (instances that joined or left meanwhile).
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace

import structlog
from aiohttp import web

from services.common.config import as_dict
from services.common.election import watch_leader
from services.common.errors import Unavailable
from services.common.peer_address import host_port
from services.common.registry import DRAIN_MARKS, Registry
from services.common.signals import stop_event
from services.common.startup import StartupError
from services.frontend.bad_http import FrontendRunner
from services.frontend.config import FrontendConfig
from services.frontend.dispatch import Dispatcher, Membership, NoInstances
from services.frontend.etcd_view import EtcdInstances, EtcdLeader
from services.frontend.instance_client import InstanceClients
from services.frontend.manager_client import LeaderSource, ManagerClient, StaticLeader
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.sampling_defaults import load_sampling_defaults
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer

log = structlog.get_logger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# After the grace every request has ended or been cut; its handler only writes its last bytes.
# (aiohttp waits this long for handlers, then as long again after cancelling them.)
HANDLERS_EXIT_S = 1.0


async def main(config: FrontendConfig) -> None:
    log.info("config_resolved", **as_dict(config))
    try:
        model = await asyncio.to_thread(load_model, config)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    registry = Registry(config.etcd_endpoints, config.cluster,
                        access=config.etcd_access) if config.etcd_endpoints else None
    stop = stop_event()
    if registry is not None:
        await registry.wait_until_reachable(config.etcd_wait_s, stop)
    membership, leader = await watch_cluster(config, registry)
    metrics = FrontendMetrics()
    metrics.watch_staleness(lambda: membership.staleness_s)
    manager = ManagerClient(leader, config.dispatch_timeout_s, config.tls) if leader is not None else None
    dispatcher = Dispatcher(manager, membership, cooldown_s=config.failed_instance_cooldown_s,
                            on_fallback=metrics.dispatch_fallbacks.inc,
                            on_role_fallback=metrics.dispatch_role_fallbacks.inc, vocab_size=model.vocab_size,
                            model_fingerprint=model.fingerprint)
    instances = InstanceClients(config.generate_timeout_s, config.abort_timeout_s, config.tls)
    runner = RequestRunner(dispatcher, instances, max_resumes=config.max_resumes, max_handoffs=config.max_handoffs,
                           resume_wait_s=config.resume_wait_s, on_resume=metrics.resumes.inc, on_handoff=metrics.handoffs.inc)
    server = FrontendServer(model, runner, dispatcher, metrics, api_keys=config.api_key,
                            max_inflight=config.max_inflight, max_body_bytes=config.max_body_bytes,
                            body_timeout_s=config.body_timeout_s, send_timeout_s=config.send_timeout_s,
                            allowed_origins=config.allowed_origins,
                            reject_unknown_fields=config.reject_unknown_fields)
    try:
        await serve(config, server, registry, stop)
    finally:
        await instances.close()
        if manager is not None:
            await manager.close()
        if registry is not None:
            await registry.close()


def load_model(config: FrontendConfig) -> ServedModel:
    """The --model folder as served, with its generation config's sampling defaults (logged, as vLLM warns)."""
    model = ServedModel.load(config.model, config.model_name, config.max_model_len, config.tool_call_parser)
    defaults = load_sampling_defaults(config.model, config.generation_config, config.override_generation_config)
    if defaults.as_fields():
        chat_max_tokens = {"chat_max_tokens": defaults.max_tokens} if defaults.max_tokens is not None else {}
        log.info("sampling_defaults_applied", generation_config=config.generation_config,
                 override_generation_config=config.override_generation_config or None,
                 **defaults.request_fields(), **chat_max_tokens,
                 hint="requests that leave these fields out get these values (the model creator's "
                      "recommendation); start with --generation-config vllm for OpenAI's defaults")
    return replace(model, sampling_defaults=defaults)


async def watch_cluster(config: FrontendConfig, registry: Registry | None) -> tuple[Membership, LeaderSource | None]:
    membership: Membership = NoInstances()
    leader: LeaderSource | None = StaticLeader(config.manager_address) if config.manager_address else None
    if registry is not None:
        membership = EtcdInstances(await registry.watch("instances"), await registry.watch(DRAIN_MARKS))
        if leader is None:
            leader = EtcdLeader(await watch_leader(registry))
    return membership, leader


async def serve(config: FrontendConfig, server: FrontendServer, registry: Registry | None,
                stop: asyncio.Event) -> None:
    http = FrontendRunner(server.app(), handler_cancellation=True, access_log=None,
                          shutdown_timeout=HANDLERS_EXIT_S, keepalive_timeout=config.keepalive_timeout_s)
    await http.setup()
    site = web.TCPSite(http, config.host, config.port)
    try:
        await site.start()
    except OSError as exc:
        await http.cleanup()
        raise StartupError(f"--port {config.port}: cannot serve HTTP on {config.host or '0.0.0.0'}: "
                           f"{exc.strerror or exc}; pick another --port or --host") from exc
    port = _bound_port(http, config.port)
    address = host_port("127.0.0.1" if config.host in _WILDCARD_HOSTS else config.host, port)
    frontend_id = config.frontend_id or f"{socket.gethostname()}-{port}"
    if registry is not None:
        await registry.register("frontends", frontend_id, {"frontend_id": frontend_id, "address": address,
                                                           "pid": os.getpid(), "host": socket.gethostname()})
    log.info("frontend_ready", frontend_id=frontend_id, address=address, model=config.model_name)
    config.print_ready(frontend_id, f"http://{address}")
    await stop.wait()
    log.info("frontend_stopping", frontend_id=frontend_id)
    server.is_accepting = False
    if registry is not None:
        await _leave(registry, frontend_id)
    await server.in_flight.finish_or_cut(config.shutdown_grace_s)
    await http.cleanup()  # every handler has ended or is writing its last bytes
    log.info("frontend_stopped", frontend_id=frontend_id)


async def _leave(registry: Registry, frontend_id: str) -> None:
    """Our frontends/<id> key out of etcd, the lease and the instance watches kept for the grace (main closes the
    registry after it: before, closing it here froze the view that resumes during the grace dispatch from)."""
    try:
        await registry.unregister("frontends", frontend_id)
    except Unavailable as exc:  # etcd away: the key goes when the lease is revoked or expires
        log.warning("frontend_unregister_failed", frontend_id=frontend_id, error=exc.message)


def _bound_port(http: FrontendRunner, configured: int) -> int:
    for address in http.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return configured
