"""gRPC servicers of the manager: thin, proto -> domain -> core -> proto.

ManagerService (Dispatch, ReportLoad) is served by the leader only; a standby answers
UNAVAILABLE "not the leader; leader is at ADDR".

AdminService is served by every manager:
* writes (SetPolicy, Drain, Undrain) go to etcd config/, which every manager watches, so
  any manager can take them;
* GetPolicy and ListRequests (a fan-out to the instances) are answered locally;
* ListInstances, GetClusterStatus and Drain's and Undrain's answers need the load reports, which only
  the leader has: a standby forwards them to the leader, and answers from its own view
  (membership and drain marks, no load; instances show UNHEALTHY) only if no leader
  answers in time. `GetClusterStatusResponse.answered_by` says whose view it is.
* Migrate and ListMigrations belong to the leader (it runs the migrations and keeps
  their history): a standby forwards them; with no leader, Migrate is UNAVAILABLE.
  Migrate finds a named request's instance with the ListRequests fan-out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from services.common.error_text import error_text, typed_error_text
from services.common.errors import Aborted, FerryError, InvalidArgument, NotFound, Unavailable
from services.common.ids import check_id
from services.common.etcd_client import ETCD_ERRORS
from services.common.gen.ferry.v1 import instance_pb2, manager_pb2, manager_pb2_grpc
from services.common.grpc_server import AddServicerFn
from services.common.tls import TlsConfig
from services.manager import convert, metrics
from services.manager.client import FORWARDED_KEY, ManagerClient
from services.manager.cluster_view import ClusterView
from services.manager.config_store import ConfigStore
from services.manager.dispatcher import Dispatcher
from services.manager.domain import InstanceId
from services.manager.instance_client import InstanceChannels
from services.manager.leadership import Leadership
from services.manager.migration_journal import MigrationJournal
from services.manager.scaling import Scaler
from services.manager.migration_settle import UNANSWERED_CHECK_TIMEOUT_S
from services.manager.migrator import Migrator
from services.manager.migration_policies import PAIRING_NAMES
from services.manager.policies import POLICY_NAMES

log = structlog.get_logger(__name__)

MANAGER_SERVICE = manager_pb2.DESCRIPTOR.services_by_name["ManagerService"].full_name
ADMIN_SERVICE = manager_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
UNREACHABLE_KEY = "x-ferry-unreachable-instances"  # trailing metadata of a partial ListRequests


class ManagerServicer(manager_pb2_grpc.ManagerServiceServicer):
    def __init__(self, dispatcher: Dispatcher, view: ClusterView, leadership: Leadership,
                 migrator: Migrator | None = None) -> None:
        self._dispatcher = dispatcher
        self._view = view
        self._leadership = leadership
        self._migrator = migrator  # keeps the PD hand-offs instances report (ReportMigration)

    async def Dispatch(self, request: manager_pb2.DispatchRequest, context) -> manager_pb2.DispatchResponse:
        started = time.perf_counter()
        try:
            placement = self._dispatcher.dispatch(convert.dispatch_ask_from_proto(request))
        except FerryError:
            metrics.DISPATCH_REFUSALS.inc()
            raise
        metrics.DISPATCH_LATENCY.observe(time.perf_counter() - started)
        metrics.DISPATCHES.labels(placement.policy).inc()
        log.info("request_dispatched", request_id=request.request_id, instance_id=placement.instance_id,
                  policy=placement.policy)
        return convert.placement_to_proto(placement)

    async def PlaceDecode(self, request: manager_pb2.PlaceDecodeRequest, context) -> manager_pb2.PlaceDecodeResponse:
        """The decode instance a prefill instance's request moves to (the PD push)."""
        if not request.request_id or not request.src_instance_id:
            raise InvalidArgument("request_id and src_instance_id: both required")
        placement = self._dispatcher.place_decode(request.request_id, request.src_instance_id,
                                                  max(request.num_blocks, 0),
                                                  frozenset(InstanceId(i) for i in request.exclude_instance_ids),
                                                  max(request.max_num_tokens, 0))
        return manager_pb2.PlaceDecodeResponse(instance_id=placement.instance_id, address=placement.address)

    async def ReportMigration(self, request: manager_pb2.MigrationRecord,
                              context) -> manager_pb2.ReportMigrationResponse:
        """Keep a PD hand-off the source ran itself in the history (and the metrics)."""
        self._leadership.check_leader()
        if self._migrator is None:
            raise Unavailable("this manager keeps no migration history; report to the leader")
        addresses = [self._view.record(InstanceId(i)).address if self._view.has_member(i) else ""
                     for i in (request.src_instance_id, request.dst_instance_id)]
        record = convert.reported_migration_from_proto(request, *addresses)
        self._migrator.keep_reported(record)
        if record.reason == "UNAVAILABLE":  # the source is here; the destination did not answer it
            self._view.mark_unanswered(record.order.dst_instance_id)
        return manager_pb2.ReportMigrationResponse()

    async def ReportLoad(self, request_iterator, context) -> manager_pb2.ReportLoadResponse:
        """Keep each report as the instance's load; end the stream (UNAVAILABLE) once we stop leading.
        When the stream ends the instance is UNHEALTHY until it reports again: a killed instance gets no
        more placements from that moment, not --report-timeout-s later. (A killed client's stream ends
        here as a closed one does; a live instance moving to a new leader reports to it at once.)"""
        instance_id, heard_at = None, None
        try:
            async for report in request_iterator:
                self._leadership.check_leader()
                if not report.instance_id:
                    raise InvalidArgument("LoadReport.instance_id is empty; set it to the instance's --instance-id")
                if instance_id is None:
                    instance_id = report.instance_id
                    log.info("load_stream_opened", instance_id=instance_id, peer=context.peer())
                heard_at = self._view.apply_report(InstanceId(report.instance_id), convert.load_from_proto(report))
                metrics.LOAD_REPORTS.inc()
        finally:
            if instance_id is not None:
                log.info("load_stream_closed", instance_id=instance_id)
            if heard_at is not None:
                self._view.note_report_stream_ended(InstanceId(instance_id), heard_at)
        return manager_pb2.ReportLoadResponse()


class AdminServicer(manager_pb2_grpc.AdminServiceServicer):
    def __init__(self, view: ClusterView, dispatcher: Dispatcher, leadership: Leadership, store: ConfigStore,
                 instances: InstanceChannels, migrator: Migrator, scaler: Scaler, list_requests_timeout_s: float,
                 forward_timeout_s: float, migrate_timeout_s: float, tls: TlsConfig | None = None,
                 admin_token: str = "", journal: MigrationJournal | None = None) -> None:
        self._view = view
        self._dispatcher = dispatcher
        self._leadership = leadership
        self._store = store
        self._instances = instances
        self._migrator = migrator
        self._list_requests_timeout_s = list_requests_timeout_s
        self._forward_timeout_s = forward_timeout_s
        # A forwarded Migrate waits as long as the leader's slowest one, plus the forwarding itself.
        self._forwarded_migrate_timeout_s = leader_migrate_time_s(migrate_timeout_s,
                                                                  list_requests_timeout_s) + forward_timeout_s
        self._tls = tls  # of the channel to the leader when forwarding
        self._admin_token = admin_token  # the leader checks the same token
        self._leader_client: ManagerClient | None = None
        self._retired_clients: set[ManagerClient] = set()  # of former leaders, until their calls could end
        self._retire_tasks: set[asyncio.Task[None]] = set()  # each closes one of them when its time comes
        self._journal = journal  # the history in etcd; None: this manager's memory only
        self._scaler = scaler
        # SetPolicy stores and applies under it: applied in the order stored (an earlier merge applied last would
        # undo a later one's field here until the config watch applied what is stored).
        self._policy_lock = asyncio.Lock()

    async def ListInstances(self, request, context) -> manager_pb2.ListInstancesResponse:
        if (answer := await self._leader_answer(context, "ListInstances",
                                                lambda c: c.instance_listing(is_forwarded=True))) is not None:
            return answer
        leader = self._leadership.leader
        return manager_pb2.ListInstancesResponse(instances=[convert.instance_to_proto(v) for v in self._view.instances()],
                                                 leader_id=leader.manager_id if leader else "",
                                                 answered_by=self._leadership.me.manager_id)

    async def GetClusterStatus(self, request, context) -> manager_pb2.GetClusterStatusResponse:
        if (answer := await self._leader_answer(context, "GetClusterStatus",
                                                lambda c: c.get_cluster_status(is_forwarded=True))) is not None:
            return answer
        leader = self._leadership.leader
        return convert.cluster_status_to_proto(
            self._view.totals(), leader_id=leader.manager_id if leader else "", answered_by=self._leadership.me.manager_id,
            leader_address=leader.address if leader else "", policy=self._dispatcher.policy_name,
            migrate_time_s=self._forwarded_migrate_timeout_s)

    async def ListRequests(self, request: manager_pb2.AdminListRequestsRequest, context) -> instance_pb2.ListRequestsResponse:
        """Ask every instance (or the one named) for its requests, each with a deadline."""
        if request.instance_id:
            self._registered(request.instance_id)
        ids = [InstanceId(request.instance_id)] if request.instance_id else self._view.member_ids()
        requests, unreachable = await self._fan_out_list_requests(ids, must_answer=bool(request.instance_id))
        if unreachable:
            context.set_trailing_metadata(((UNREACHABLE_KEY, ",".join(unreachable)),))
        return instance_pb2.ListRequestsResponse(requests=requests)

    async def GetPolicy(self, request, context) -> manager_pb2.Policy:
        return convert.policy_to_proto(self._dispatcher.policy_name, self._migrator.settings, self._scaler.settings)

    async def SetPolicy(self, request: manager_pb2.Policy, context) -> manager_pb2.Policy:
        """Validate, store in etcd config/policy (all managers watch it), apply here at once. Unset fields keep
        what is stored (merged in one compare-and-put, so concurrent partial calls both take effect)."""
        def merge(stored_dispatch, stored_migration, stored_scaling):
            dispatch = request.dispatch or stored_dispatch or self._dispatcher.policy_name
            if dispatch not in POLICY_NAMES:
                raise InvalidArgument(f"dispatch: unknown policy {dispatch!r}; one of: {', '.join(POLICY_NAMES)}")
            migration = convert.migration_settings_from_proto(request, stored_migration or self._migrator.settings)
            if migration.pairing not in PAIRING_NAMES:
                raise InvalidArgument(f"migration_pairing: unknown pairing {migration.pairing!r}; "
                                      f"one of: {', '.join(PAIRING_NAMES)}")
            return dispatch, migration, convert.scaling_settings_from_proto(request,
                                                                            stored_scaling or self._scaler.settings)
        async with self._policy_lock:
            try:
                dispatch, migration, scaling = await self._store.update_policy(merge)
            except ETCD_ERRORS as exc:
                raise Unavailable(f"policy not changed: etcd did not store it ({error_text(exc)}); retry") from exc
            self._dispatcher.set_policy(dispatch)
            self._migrator.set_settings(migration)
            self._scaler.set_settings(scaling)
        log.info("policy_set", dispatch=dispatch, migration_enabled=migration.is_enabled,
                 scaling_enabled=scaling.is_enabled)
        return convert.policy_to_proto(self._dispatcher.policy_name, self._migrator.settings, self._scaler.settings)

    async def Drain(self, request: manager_pb2.DrainRequest, context) -> manager_pb2.DrainResponse:
        """Mark DRAINING (no new dispatches) in etcd config/drain/<id>, so a new leader keeps the mark.

        The leader's migration loop then moves every request off it; call Drain again (or
        ListInstances) to see `is_drained` once nothing runs, waits or is suspended there. One that left while the
        mark was stored (its lease ended) keeps the mark and is answered without a state, as by Undrain.
        """
        instance_id = self._registered(request.instance_id)
        if (answer := await self._leader_answer(context, "Drain",
                                                lambda c: c.drain(instance_id, is_forwarded=True))) is not None:
            return answer
        try:
            await self._store.put_drain(instance_id)
        except ETCD_ERRORS as exc:
            raise Unavailable(f"instance not drained: etcd did not store the mark ({error_text(exc)}); retry") from exc
        self._view.mark_drained(instance_id)
        if not self._view.has_member(instance_id):  # its lease ended while etcd stored the mark
            log.info("instance_drain_marked", instance_id=instance_id, is_registered=False)
            return manager_pb2.DrainResponse(instance_id=instance_id)  # state unspecified: it is not there
        log.info("instance_drain_marked", instance_id=instance_id, is_drained=self._view.instance(instance_id).is_drained)
        return self._drain_answer(instance_id)

    async def Undrain(self, request: manager_pb2.UndrainRequest, context) -> manager_pb2.DrainResponse:
        """Delete the drain mark: new requests reach the instance again. A scaling retirement of it
        that still drains is called off; one already stoppable is FAILED_PRECONDITION. An instance
        that drains itself (shutting down: its own etcd record says so) stays DRAINING. The mark of an
        instance that is not registered now (stopped; one coming back under its id would drain) goes too. One with
        neither is NOT_FOUND, also one whose lease lapsed (etcd away, a freeze) in its own shutdown: its drain mark
        went with that lease, and it puts the mark back when it registers again, seconds later; undone then."""
        if request.instance_id and self._view.has_drain_mark(request.instance_id):
            instance_id = InstanceId(request.instance_id)
        else:
            instance_id = self._registered(request.instance_id, "it has no drain mark either: nothing was undone. "
                                           "One whose etcd lease lapsed registers again within seconds (one shutting "
                                           "down drains itself again then): undrain it once ListInstances lists it")
        if (answer := await self._leader_answer(context, "Undrain",
                                                lambda c: c.undrain(instance_id, is_forwarded=True))) is not None:
            return answer
        try:
            await self._scaler.call_off(instance_id)
            await self._store.delete_drain(instance_id)
        except ETCD_ERRORS as exc:
            raise Unavailable(f"instance still drained: etcd did not delete the mark ({error_text(exc)}); "
                              "retry") from exc
        self._view.unmark_drained(instance_id)
        log.info("instance_drain_removed", instance_id=instance_id)
        if not self._view.has_member(instance_id):
            return manager_pb2.DrainResponse(instance_id=instance_id)  # state unspecified: it is not there
        return self._drain_answer(instance_id)

    async def _leader_answer(self, context, method: str, call: Callable[[ManagerClient], Awaitable[Any]]) -> Any:
        """On a standby, the leader's answer to `call`; None to answer here (we lead, or the leader
        did not answer in time: then the caller answers from this manager's own view)."""
        client = await self._leader_to_forward_to(context)
        if client is None:
            return None
        try:
            return await call(client)
        except Unavailable as exc:
            log.warning("admin_forward_failed", method=method, leader=client.address, error=exc.message)
            return None

    def _registered(self, instance_id: str, why_absent: str = "see ListInstances for the ids") -> InstanceId:
        if not instance_id:
            raise InvalidArgument("instance_id: required (see ListInstances for the ids)")
        check_id("instance_id", instance_id)
        if not self._view.has_member(instance_id):
            raise NotFound(f"instance {instance_id!r} is not registered; {why_absent}")
        return InstanceId(instance_id)

    def _drain_answer(self, instance_id: InstanceId) -> manager_pb2.DrainResponse:
        view = self._view.instance(instance_id)
        return manager_pb2.DrainResponse(instance_id=instance_id, state=convert.state_to_proto(view.state),
                                         is_drained=view.is_drained,
                                         num_remaining=view.load.num_held)

    async def Migrate(self, request: manager_pb2.MigrateRequest, context) -> manager_pb2.MigrateResponse:
        """Live-migrate one request now (see Migrator.admin_order for the checks); the source's figures.
        With no request and no source named, the least free busy instance gives one of its requests."""
        if request.src_instance_id and request.src_instance_id == request.dst_instance_id:
            raise InvalidArgument(f"dst_instance_id: src_instance_id names {request.src_instance_id} too; name "
                                  "another destination, or leave it empty for the freest serving instance")
        client = await self._leader_to_forward_to(context)
        if client is not None:
            return await client.migrate(request.request_id, request.src_instance_id, request.dst_instance_id,
                                        timeout_s=self._forwarded_migrate_timeout_s,
                                        is_forwarded=True)
        self._leadership.check_leader()
        src_id = request.src_instance_id
        if not src_id:
            src_id = (await self._instance_running(request.request_id) if request.request_id
                      else self._migrator.busiest_source(request.dst_instance_id))
        order = self._migrator.admin_order(src_id, request.dst_instance_id, request.request_id)
        self._leadership.check_leader()  # again: finding the source may have taken a while (ListRequests)
        try:
            record = await self._migrator.migrate_to_the_end(order)
        except NotFound as exc:
            if request.request_id:
                await self._name_where_it_runs(request.request_id, src_id, bool(request.src_instance_id), exc)
            raise
        return convert.migrate_response_to_proto(record)

    async def _name_where_it_runs(self, request_id: str, src_id: str, is_named: bool, error: NotFound) -> None:
        """A Migrate whose source does not hold the request (any more): NotFound naming the instance that
        does where the caller named the source, Aborted where we found it there and it moved meanwhile
        (another migration: a retry finds it)."""
        try:
            running_on = await self._instance_running(request_id)
        except FerryError:
            return  # on none that answered: the source's own answer says enough
        if running_on == src_id:
            return
        if is_named:
            raise NotFound(f"request {request_id!r} is not on instance {src_id}: it runs on {running_on}; name "
                           "that source or leave the source out") from error
        raise Aborted(f"request {request_id!r} moved from {src_id} to {running_on} while this Migrate was "
                      "under way (another migration); try again") from error

    async def ListMigrations(self, request: manager_pb2.ListMigrationsRequest,
                             context) -> manager_pb2.ListMigrationsResponse:
        if (answer := await self._leader_answer(context, "ListMigrations", lambda c: c.list_migrations(
                request.instance_id, request.request_id, is_forwarded=True))) is not None:
            return answer
        records = await self._migration_history()
        return manager_pb2.ListMigrationsResponse(migrations=[r for r in records if _matches(r, request)])

    async def _migration_history(self) -> list[manager_pb2.MigrationRecord]:
        """etcd's history and what this manager kept since; its memory alone if etcd does not answer."""
        recent = self._migrator.history()
        if self._journal is not None:
            try:
                return await self._journal.history(recent)
            except ETCD_ERRORS as exc:
                log.warning("migration_history_unread", error=typed_error_text(exc))
        return [convert.migration_record_to_proto(r) for r in recent]

    async def SetRole(self, request: manager_pb2.AdminSetRoleRequest, context) -> instance_pb2.SetRoleResponse:
        """Switch an instance's role at runtime: the instance itself rewrites its etcd record (every manager
        sees it) and moves away the requests that no longer fit, so any manager can take this call."""
        instance_id = self._registered(request.instance_id)
        role = convert.role_from_proto(request.role)
        address = self._view.record(instance_id).address
        reply = await self._instances.set_role(address, convert.role_to_proto(role), self._forward_timeout_s * 5)
        log.info("instance_role_set", instance_id=request.instance_id, role=role.value,
                 num_moving=reply.num_moving)
        return reply

    async def close(self) -> None:
        for task in self._retire_tasks:
            task.cancel()
        await asyncio.gather(*self._retire_tasks, return_exceptions=True)
        for client in [self._leader_client, *self._retired_clients]:
            if client is not None:
                await client.close()

    def _retire(self, client: ManagerClient) -> None:
        """A client of a former leader: forwarded calls may still be using it (a Migrate runs up to
        leader_migrate_time_s), so it is closed once the longest of them could have ended, not now."""
        self._retired_clients.add(client)
        task = asyncio.create_task(self._close_retired(client, self._forwarded_migrate_timeout_s + 1))
        self._retire_tasks.add(task)  # asyncio keeps only a weak reference
        task.add_done_callback(self._retire_tasks.discard)

    async def _close_retired(self, client: ManagerClient, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._retired_clients.discard(client)
        await client.close()

    async def _fan_out_list_requests(self, ids: list[InstanceId],
                                     must_answer: bool) -> tuple[list[instance_pb2.RequestInfo], list[InstanceId]]:
        """The requests of instances `ids`, and the ids that did not answer (Unavailable if `must_answer`)."""
        addresses = {i: self._view.record(i).address for i in ids}
        replies = await asyncio.gather(*(self._instances.list_requests(a, self._list_requests_timeout_s)
                                         for a in addresses.values()), return_exceptions=True)
        requests, unreachable = [], []
        for instance_id, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, FerryError):
                if must_answer:
                    raise Unavailable(f"instance {instance_id} did not answer ListRequests: {reply.message}")
                unreachable.append(instance_id)
                log.warning("instance_list_requests_failed", instance_id=instance_id, error=reply.message)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                requests.extend(reply)
        return requests, unreachable

    async def _instance_running(self, request_id: str) -> str:
        """The instance that holds `request_id` (running or waiting); NotFound if none does."""
        requests, unreachable = await self._fan_out_list_requests(self._view.member_ids(), must_answer=False)
        for info in requests:
            if info.request_id == request_id and info.state != "finished":
                return info.instance_id
        if unreachable:  # it may well be on one of them (a long prefill step keeps an instance from answering)
            raise Unavailable(f"request {request_id!r} is on none of the instances that answered, and instances "
                              f"{', '.join(unreachable)} did not answer within {self._list_requests_timeout_s:g} s; "
                              "retry, or name the source instance")
        choices = sorted(info.request_id for info in requests
                         if info.request_id.startswith(f"{request_id}-") and info.request_id[len(request_id) + 1:].isdigit()
                         and info.state != "finished")
        if choices:  # an n > 1 (or batch) request: each choice runs as a request of its own
            raise NotFound(f"request {request_id!r} runs as one request per choice: migrate one of "
                           f"{', '.join(choices[:8])}{' ...' if len(choices) > 8 else ''}")
        raise NotFound(f"request {request_id!r} is not running or waiting on any instance (finished, or never "
                       "started); see ListRequests")

    async def _leader_to_forward_to(self, context) -> ManagerClient | None:
        """A client of the leader if this manager should forward an admin read, else None."""
        leader = self._leadership.leader
        is_forwarded = any(key == FORWARDED_KEY for key, _ in context.invocation_metadata() or ())
        if leader is None or self._leadership.is_leader or is_forwarded:
            return None
        if self._leader_client is None or self._leader_client.address != leader.address:
            if self._leader_client is not None:
                self._retire(self._leader_client)
            self._leader_client = ManagerClient(leader.address, timeout_s=self._forward_timeout_s, tls=self._tls,
                                                admin_token=self._admin_token)
        return self._leader_client


def leader_migrate_time_s(migrate_timeout_s: float, list_requests_timeout_s: float) -> float:
    """The longest an AdminService.Migrate can take on the leader: finding the request's instance (a
    ListRequests fan-out), the MigrateOut call, asking the destination whether an unanswered one moved
    the request, and finding where a request the source did not hold runs (a second fan-out)."""
    return 2 * list_requests_timeout_s + migrate_timeout_s + UNANSWERED_CHECK_TIMEOUT_S


def servicers(manager: ManagerServicer, admin: AdminServicer) -> list[tuple[AddServicerFn, Any]]:
    """What `GrpcServer.start` registers for a manager."""
    return [(manager_pb2_grpc.add_ManagerServiceServicer_to_server, manager),
            (manager_pb2_grpc.add_AdminServiceServicer_to_server, admin)]


def _matches(record: manager_pb2.MigrationRecord, request: manager_pb2.ListMigrationsRequest) -> bool:
    """Of the asked instance (either side) and request, when asked."""
    return ((not request.instance_id or request.instance_id in (record.src_instance_id, record.dst_instance_id))
            and (not request.request_id or record.request_id == request.request_id))
