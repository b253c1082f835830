"""Wiring of one manager process: gRPC server, etcd membership/config watches, election, metrics.

Every manager watches instances/ and config/ and serves AdminService; only the elected
leader serves Dispatch and takes load reports (see server.py).

Its id is claimed in etcd before it serves (id_claim.py): a live manager holding it stops this one at startup.

Shutdown order (STYLE.md): health NOT_SERVING → cancel background loops → cut the
migrations still running after --shutdown-grace-s short (each kept `unknown`: its source runs
it on) and flush the migration journal while still leading → resign (revoke the election lease, so a standby
takes over at once) → server.stop(grace) → close channels and etcd clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from services.common.auth import TokenInterceptor
from services.common.config import as_dict
from services.common.election import Election, watch_leader
from services.common.error_text import error_text
from services.common.etcd_client import ETCD_ERRORS, connect_etcd
from services.common.grpc_server import GrpcServer, bind_grpc_server
from services.common.ids import default_id
from services.common.registry import Registry
from services.common.signals import stop_event
from services.common.tls import TlsConfig
from services.manager.cluster_view import ClusterView
from services.manager.config import ManagerConfig
from services.manager.config_store import ClusterSettings, ConfigStore
from services.manager.migration_journal import LeaderFence, MigrationJournal
from services.manager.dispatcher import Dispatcher
from services.manager.domain import InstanceRecord
from services.manager.election_loop import Campaign
from services.manager.id_claim import ManagerIdClaim
from services.manager.instance_client import InstanceChannels
from services.manager.leadership import Leadership
from services.manager.metrics import serve_metrics, watch_membership_staleness
from services.manager.migrator import Migrator, MigratorLimits
from services.manager.scaling import Scaler
from services.manager.server import ADMIN_SERVICE, MANAGER_SERVICE, AdminServicer, ManagerServicer, servicers

log = structlog.get_logger(__name__)


async def main(config: ManagerConfig) -> None:
    log.info("config_resolved", **as_dict(config))
    admin_token = config.resolved_admin_token
    tls = config.tls  # read once: the cluster token's file is read here
    warn_if_only_admin_api_open(tls, admin_token)
    interceptors = [TokenInterceptor(admin_token, [ADMIN_SERVICE])] if admin_token else []
    # Bound first: the manager id and the election need its port; it starts once its servicers exist.
    server = bind_grpc_server(config.host, config.port, [MANAGER_SERVICE, ADMIN_SERVICE], interceptors,
                              advertise_host=config.advertise_host or None, tls=tls,
                              token_open_services=[ADMIN_SERVICE])  # the admin API has its own token
    manager_id = config.manager_id or default_id(server.port)
    election = Election(config.etcd_endpoints, config.cluster, manager_id, server.address, config.lease_ttl_s,
                        access=config.etcd_access)
    leadership = Leadership(manager_id, server.address, lambda: election.holds_lease)
    view = ClusterView(config.report_timeout_s)
    dispatcher = Dispatcher(view, leadership, config.dispatch_policy, config.pd_short_prompt_tokens,
                            config.prefix_load_slack)
    registry = Registry(config.etcd_endpoints, config.cluster, config.lease_ttl_s, access=config.etcd_access)
    stop = stop_event()
    if config.etcd_user:  # the client authenticates as it connects: etcd must answer first
        await registry.wait_until_reachable(config.etcd_wait_s, stop)
    etcd = await connect_etcd(config.etcd_endpoints, config.etcd_access)
    store = ConfigStore(etcd, config.cluster, manager_id)
    instances = InstanceChannels(tls)
    journal = MigrationJournal(etcd, config.cluster, manager_id, config.migration_history_size,
                               LeaderFence(election.key, lambda: election.epoch))
    migrator = Migrator(view, leadership, instances, _migrator_limits(config), config.migration,
                        record_sink=journal.append, journaled=journal)
    scaler = Scaler(view, leadership, store.fenced_by(election.key, lambda: election.epoch), config.scaling,
                    config.scaling_interval_s, config.scaling_cooldown_s)
    admin = AdminServicer(view, dispatcher, leadership, store, instances, migrator, scaler,
                          config.list_requests_timeout_s, config.admin_forward_timeout_s, config.migration_timeout_s,
                          tls=tls, admin_token=admin_token, journal=journal)
    id_claim = ManagerIdClaim(registry, manager_id, server.address, is_default_id=not config.manager_id)
    try:
        await id_claim.claim()  # a live manager holding our id: StartupError, before we serve (etcd away: later)
        await server.start(servicers(ManagerServicer(dispatcher, view, leadership, migrator), admin))
        if config.metrics_port:
            serve_metrics(config.metrics_port, config.metrics_host or config.host, view, leadership,
                          dispatcher.role_gaps.is_missing)
        members = await registry.watch("instances", resync_interval_s=config.resync_interval_s)
        members.on_change(lambda change: _apply_members(view, change.members))
        watch_membership_staleness(members)
        _apply_members(view, members.members)
        apply = lambda settings: _apply_settings(dispatcher, migrator, scaler, view, config, settings)  # noqa: E731
        await _apply_stored_settings(store, apply)  # before we can win: dispatch with the stored policy
        campaign = Campaign(election, await watch_leader(registry), leadership, view, lambda: members.is_synced)
        async with asyncio.TaskGroup() as tasks:
            loops = [tasks.create_task(store.watch_loop(apply), name="config_watch_loop"),
                     tasks.create_task(campaign.leader_watch_loop(), name="leader_watch_loop"),
                     tasks.create_task(_campaign_once_claimed(id_claim, campaign), name="campaign_loop"),
                     tasks.create_task(migrator.migration_loop(), name="migration_loop"),
                     tasks.create_task(scaler.scaling_loop(), name="scaling_loop"),
                     tasks.create_task(dispatcher.role_gap_loop(), name="role_gap_loop")]
            journal_loop = tasks.create_task(journal.writer_loop(), name="migration_journal_loop")
            log.info("manager_ready", manager_id=manager_id, address=server.address)
            config.print_ready(manager_id, server.address)
            await stop.wait()
            await _shutdown(config, server, campaign, loops,
                            lambda: _close_migrations(migrator, journal, journal_loop, config.shutdown_grace_s))
    finally:
        await server.stop(0)  # stopped already unless something failed on the way (a taken --metrics-port)
        await migrator.close()
        await election.close()
        await admin.close()
        await instances.close()
        await registry.close()
        await etcd.close()


async def _campaign_once_claimed(id_claim: ManagerIdClaim, campaign: Campaign) -> None:
    """Campaign only under an id this manager holds (id_claim.py): etcd may not have answered the claim at startup."""
    await id_claim.claim_loop()
    await campaign.campaign_loop()


async def _shutdown(config: ManagerConfig, server: GrpcServer, campaign: Campaign, loops: list[asyncio.Task],
                    close_migrations: Callable[[], Awaitable[None]]) -> None:
    log.info("manager_stopping")
    await server.set_serving(False)
    for loop in loops:
        loop.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    await close_migrations()  # while still leading: the journal takes records only from the leader
    await campaign.resign()
    await server.stop(config.shutdown_grace_s)
    log.info("manager_stopped")


async def _close_migrations(migrator: Migrator, journal: MigrationJournal, journal_loop: asyncio.Task,
                            grace_s: float) -> None:
    """Migrations still running after `grace_s` are kept `unknown`, and the journal written, within its flush
    timeout."""
    await migrator.close(grace_s)
    await journal.flush()
    journal_loop.cancel()
    await asyncio.gather(journal_loop, return_exceptions=True)


def _apply_members(view: ClusterView, members: Mapping[str, dict[str, Any]]) -> None:
    records = []
    for instance_id, value in members.items():
        try:
            records.append(InstanceRecord.from_dict(instance_id, value))
        except ValueError as exc:
            log.warning("instance_record_invalid", instance_id=instance_id, error=error_text(exc))
    view.replace_members(records)


def warn_if_only_admin_api_open(tls: TlsConfig, admin_token: str) -> None:
    """A cluster token without an admin token guards everything but the most powerful API: say so."""
    if tls.cluster_token and not admin_token:
        log.warning("admin_api_open", reason="a cluster token guards the internal services, but AdminService "
                    "(SetPolicy, Migrate, Drain, SetRole) answers anyone who reaches this port: "
                    "set --admin-token-file")


def _migrator_limits(config: ManagerConfig) -> MigratorLimits:
    return MigratorLimits(interval_s=config.migration_interval_s, max_per_instance=config.migration_max_per_instance,
                          cooldown_s=config.migration_cooldown_s, timeout_s=config.migration_timeout_s,
                          history_size=config.migration_history_size, backend=config.migration_backend,
                          failure_backoff_s=config.migration_failure_backoff_s)


def _apply_settings(dispatcher: Dispatcher, migrator: Migrator, scaler: Scaler, view: ClusterView,
                    config: ManagerConfig, settings: ClusterSettings) -> None:
    dispatcher.set_policy(settings.dispatch_policy or config.dispatch_policy)
    migrator.set_settings(settings.migration or config.migration)
    scaler.set_settings(settings.scaling or config.scaling)
    view.replace_drained(settings.drained)


async def _apply_stored_settings(store: ConfigStore, apply: Callable[[ClusterSettings], None]) -> None:
    try:
        settings, _ = await store.read()
    except ETCD_ERRORS as exc:  # config_watch_loop keeps trying
        log.warning("stored_settings_unread", error=error_text(exc))
        return
    apply(settings)
