"""Typed async client of AdminService for ferryctl: proto replies become `records`.

The only ferryctl module that touches generated code. Every call has a deadline and an
optional bearer token; failures come back as ferry errors (`services.common.errors`).
Calls that an older manager does not implement (Migrate, ListMigrations, SetRole came
later) raise `NotAvailableYet` instead of a raw UNIMPLEMENTED.
"""

from __future__ import annotations

import os
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from services.common.errors import FerryError, Unavailable, error_from_rpc
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2, manager_pb2_grpc
from services.common.auth import bearer_metadata
from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig
from services.ctl.records import (ClusterStatus, DrainResult, InstanceListing, InstanceRow, MigrateResult, MigrationRow,
                                 RequestList, RequestRow)

UNREACHABLE_KEY = "x-ferry-unreachable-instances"  # trailing metadata of a partial ListRequests
ROLES = ("both", "prefill", "decode")


# A migration copies a request's whole KV cache, after its prefill if it is still prefilling. The manager says
# how long its Migrate may take (GetClusterStatusResponse.migrate_time_s: services/manager/server.py
# leader_migrate_time_s, + a standby's forwarding; 67 s at its defaults); ferryctl waits that + MIGRATE_MARGIN_S,
# or MIGRATE_TIMEOUT_S where an older manager does not say; --timeout-s waits longer.
MIGRATE_TIMEOUT_S = 75.0
MIGRATE_MARGIN_S = 5.0


class NotAvailableYet(FerryError):
    """The manager does not implement this admin call (it runs an older ferry)."""


class AdminClient:
    def __init__(self, address: str, token: str = "", timeout_s: float = 5.0, tls: TlsConfig | None = None) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        self._channel = secure_or_insecure_channel(address, tls)
        self._admin = manager_pb2_grpc.AdminServiceStub(self._channel)

    def is_connected(self) -> bool:
        """Whether the channel to the manager is up (after a failed call: whether the manager answered it)."""
        return self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def list_instances(self) -> list[InstanceRow]:
        return list((await self.instance_listing()).rows)

    async def instance_listing(self) -> InstanceListing:
        """The instances, by id, with whose view they are."""
        reply = await self._call(self._admin.ListInstances, manager_pb2.ListInstancesRequest())
        rows = sorted((instance_from_proto(i) for i in reply.instances), key=lambda row: row.instance_id)
        return InstanceListing(tuple(rows), leader_id=reply.leader_id, answered_by=reply.answered_by)

    async def list_requests(self, instance_id: str = "") -> RequestList:
        call = self._admin.ListRequests(manager_pb2.AdminListRequestsRequest(instance_id=instance_id),
                                        timeout=self._timeout_s, metadata=self._metadata or None)
        try:
            reply = await call
            trailing = await call.trailing_metadata() or ()
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        unreachable = next((value for key, value in trailing if key == UNREACHABLE_KEY), "")
        rows = sorted((request_from_proto(r) for r in reply.requests), key=lambda row: (row.instance_id, row.request_id))
        return RequestList(tuple(rows), tuple(i for i in unreachable.split(",") if i))

    async def cluster_status(self) -> ClusterStatus:
        return status_from_proto(await self._call(self._admin.GetClusterStatus, manager_pb2.GetClusterStatusRequest()))

    async def get_policy(self) -> dict[str, Any]:
        """Every policy field by its proto name (dispatch, and the migration knobs where the build has them)."""
        return policy_from_proto(await self._call(self._admin.GetPolicy, manager_pb2.GetPolicyRequest()))

    async def set_policy(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Change the named policy fields (proto names; enums by name); the others keep their values."""
        known = manager_pb2.Policy.DESCRIPTOR.fields_by_name
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"policy has no field {', '.join(unknown)}; its fields: {', '.join(known)}")
        fields = {name: _full_enum_name(known[name], value) for name, value in fields.items()}
        for name, value in fields.items():
            try:
                json_format.ParseDict({name: value}, manager_pb2.Policy())
            except json_format.ParseError:
                raise ValueError(f"--set {name}={value}: expected {_expected(known[name])}") from None
        request = json_format.ParseDict(fields, manager_pb2.Policy())
        return policy_from_proto(await self._call(self._admin.SetPolicy, request))

    async def drain(self, instance_id: str, undo: bool = False) -> DrainResult:
        """Drain the instance, or with `undo` take it back (Undrain)."""
        if undo:
            reply = await self._call(self._admin.Undrain, manager_pb2.UndrainRequest(instance_id=instance_id))
        else:
            reply = await self._call(self._admin.Drain, manager_pb2.DrainRequest(instance_id=instance_id))
        return DrainResult(reply.instance_id, enum_label(common_pb2.InstanceState, reply.state, "INSTANCE_STATE_"),
                           is_drained=getattr(reply, "is_drained", False),
                           num_remaining=getattr(reply, "num_remaining", 0))

    async def list_migrations(self, instance_id: str = "", request_id: str = "") -> list[MigrationRow]:
        """The leader's recent migrations, oldest first."""
        fields = {"instance_id": instance_id, "request_id": request_id}
        request = manager_pb2.ListMigrationsRequest(**{k: v for k, v in fields.items() if v})
        reply = await self._call_optional("ListMigrations", request)
        return [migration_from_proto(record) for record in reply.migrations]

    async def migrate(self, request_id: str = "", src_instance_id: str = "", dst_instance_id: str = "") -> MigrateResult:
        """Move a running request (or the manager's pick from `src_instance_id`) to another instance."""
        fields = {"request_id": request_id, "src_instance_id": src_instance_id, "dst_instance_id": dst_instance_id}
        request = manager_pb2.MigrateRequest(**{k: v for k, v in fields.items() if v})
        migrate_time_s = await self._migrate_time_s()
        deadline_s = max(self._timeout_s, migrate_time_s + MIGRATE_MARGIN_S if migrate_time_s else MIGRATE_TIMEOUT_S)
        if migrate_time_s:
            why = (f"the manager's Migrate takes up to {migrate_time_s:g} s, from its --migration-timeout-s; pass a "
                   "longer --timeout-s to wait longer")
        else:
            why = "for a manager whose --migration-timeout-s is above 60 s, pass --timeout-s above it plus 10 s"
        past_deadline = (f"ferryctl stopped waiting after {deadline_s:g} s; the migration may still end (see "
                         f"`ferryctl migrations`): {why}")
        return migrate_from_proto(await self._call_optional("Migrate", request, deadline_s, past_deadline))

    async def _migrate_time_s(self) -> float:
        """How long the manager says its Migrate may take; 0 where it does not say (an older manager) or does
        not answer (the Migrate then tells why)."""
        try:
            reply = await self._call(self._admin.GetClusterStatus, manager_pb2.GetClusterStatusRequest())
        except FerryError:  # not swallowed: the Migrate right after meets the same and raises it
            return 0.0
        return reply.migrate_time_s

    async def set_role(self, instance_id: str, role: str) -> str:
        """Change an instance's role (both | prefill | decode); returns the role it now has."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        wire_role = common_pb2.Role.Value(f"ROLE_{role.upper()}")
        reply = await self._call_optional("SetRole", manager_pb2.AdminSetRoleRequest(instance_id=instance_id,
                                                                                     role=wire_role))
        return enum_label(common_pb2.Role, reply.role, "ROLE_")

    async def _call_optional(self, method: str, request: Any, timeout_s: float | None = None,
                             past_deadline: str = "") -> Any:
        """`past_deadline`: the message of the Unavailable raised when the call outlives its deadline."""
        try:
            return await getattr(self._admin, method)(request, timeout=timeout_s or self._timeout_s,
                                                      metadata=self._metadata or None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise NotAvailableYet(f"{method} is not available: the manager at {self.address} does not "
                                      f"implement AdminService/{method} (it runs an older ferry; upgrade it)") from None
            if past_deadline and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(past_deadline) from None
            raise error_from_rpc(exc) from None

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self._timeout_s, metadata=self._metadata or None)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None


def enum_label(enum_type: Any, value: int, prefix: str) -> str:
    """ROLE_PREFILL -> "prefill"; unknown numbers stay visible as numbers."""
    try:
        name = enum_type.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower()


def instance_from_proto(info: manager_pb2.InstanceInfo) -> InstanceRow:
    return InstanceRow(
        instance_id=info.instance_id, address=info.address, role=enum_label(common_pb2.Role, info.role, "ROLE_"),
        state=enum_label(common_pb2.InstanceState, info.state, "INSTANCE_STATE_"), model=info.model, host=info.host,
        pid=info.pid, num_running=info.num_running, num_waiting=info.num_waiting, num_free_blocks=info.num_free_blocks,
        num_total_blocks=info.num_total_blocks, freeness=info.freeness, num_requests_served=info.num_requests_served,
        num_dispatched=info.num_dispatched, report_age_s=info.report_age_s,
        prefix_cache_queried_tokens=info.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=info.prefix_cache_hit_tokens,
        num_free_slots=info.num_free_slots if info.HasField("num_free_slots") else None,
        max_num_seqs=info.max_num_seqs, is_drained=info.is_drained, num_preemptions=info.num_preemptions,
        model_fingerprint=info.model_fingerprint)


def request_from_proto(info: instance_pb2.RequestInfo) -> RequestRow:
    return RequestRow(request_id=info.request_id, instance_id=info.instance_id, state=info.state,
                      num_tokens=info.num_tokens, num_output_tokens=info.num_output_tokens)


def status_from_proto(reply: manager_pb2.GetClusterStatusResponse) -> ClusterStatus:
    return ClusterStatus(
        leader_id=reply.leader_id, leader_address=reply.leader_address, answered_by=reply.answered_by,
        dispatch_policy=reply.dispatch_policy, num_instances=reply.num_instances, num_serving=reply.num_serving,
        num_draining=reply.num_draining, num_unhealthy=reply.num_unhealthy, num_running=reply.num_running,
        num_waiting=reply.num_waiting, num_dispatched=reply.num_dispatched, average_freeness=reply.average_freeness)


def policy_from_proto(policy: manager_pb2.Policy) -> dict[str, Any]:
    return json_format.MessageToDict(policy, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def migration_from_proto(record: Any) -> MigrationRow:
    return MigrationRow(**{name: getattr(record, name) for name in MigrationRow.__dataclass_fields__})


def migrate_from_proto(reply: Any) -> MigrateResult:
    return MigrateResult(
        request_id=reply.request_id, src_instance_id=reply.src_instance_id, dst_instance_id=reply.dst_instance_id,
        num_blocks=reply.num_blocks, num_bytes=reply.num_bytes, num_stages=reply.num_stages, backend=reply.backend,
        duration_ms=reply.duration_ms, downtime_ms=reply.downtime_ms,
        num_cached_at_destination=reply.num_cached_at_destination)


def _full_enum_name(field: FieldDescriptor, value: Any) -> Any:
    """An enum value by its short name, as the manager's flags spell it (`longest_running` for
    MIGRATION_SELECTION_LONGEST_RUNNING); anything else as given."""
    if field.enum_type is None or not isinstance(value, str):
        return value
    prefix = _enum_prefix(field)
    wanted = value.strip().upper()
    matches = [v.name for v in field.enum_type.values
               if wanted in (v.name, v.name[len(prefix):]) and not v.name.endswith("_UNSPECIFIED")]
    return matches[0] if matches else value


def _enum_prefix(field: FieldDescriptor) -> str:
    """What every value name of the enum field starts with, whole words (MIGRATION_SELECTION_)."""
    prefix = os.path.commonprefix([value.name for value in field.enum_type.values])
    return prefix[:prefix.rfind("_") + 1]


def _expected(field: FieldDescriptor) -> str:
    """What a policy field takes, in words."""
    if field.enum_type is not None:
        prefix = _enum_prefix(field)
        return "one of " + ", ".join(value.name[len(prefix):].lower() for value in field.enum_type.values
                                     if not value.name.endswith("_UNSPECIFIED"))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return "true or false"
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return "a number"
    if field.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT32,
                          FieldDescriptor.CPPTYPE_UINT64):
        return "a whole number"
    return "text"
