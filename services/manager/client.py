"""Typed async client of a manager: Dispatch and ReportLoad (ManagerService), the admin API.

Every call has a deadline; failures come back as ferry errors (`services.common.errors`):
UNAVAILABLE from a standby names the leader ("not the leader; leader is at ADDR").
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import grpc

from services.common.errors import error_from_rpc
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2, manager_pb2_grpc
from services.common.auth import bearer_metadata
from services.common.grpc_server import secure_or_insecure_channel
from services.common.logging import request_metadata
from services.common.tls import TlsConfig
from services.manager.domain import InstanceId, Placement

FORWARDED_KEY = "x-ferry-forwarded"  # set when a standby forwards an admin read; the receiver never forwards again


class ManagerClient:
    def __init__(self, address: str, timeout_s: float = 1.0, tls: TlsConfig | None = None,
                 admin_token: str = "") -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._auth = bearer_metadata(admin_token)  # sent with every call (the admin API may require it)
        self._channel = secure_or_insecure_channel(address, tls)
        self._manager = manager_pb2_grpc.ManagerServiceStub(self._channel)
        self._admin = manager_pb2_grpc.AdminServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ManagerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ManagerService

    async def dispatch(self, request_id: str, num_prompt_tokens: int, max_tokens: int = 0, priority: int = 0,
                       exclude_instance_ids: Iterable[str] = (), timeout_s: float | None = None,
                       prefix_chunk_keys: Iterable[int] = ()) -> Placement:
        request = manager_pb2.DispatchRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                              max_tokens=max_tokens, priority=priority,
                                              exclude_instance_ids=list(exclude_instance_ids),
                                              prefix_chunk_keys=list(prefix_chunk_keys))
        reply = await self._call(self._manager.Dispatch, request, timeout_s, request_metadata(request_id))
        return Placement(InstanceId(reply.instance_id), reply.address, reply.policy)

    async def report_load(self, reports: AsyncIterable[common_pb2.LoadReport]) -> None:
        """Stream `reports` until they end (no deadline: the stream lives as long as the instance)."""
        try:
            await self._manager.ReportLoad(reports)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    # AdminService

    async def list_instances(self, is_forwarded: bool = False) -> list[manager_pb2.InstanceInfo]:
        return list((await self.instance_listing(is_forwarded)).instances)

    async def instance_listing(self, is_forwarded: bool = False) -> manager_pb2.ListInstancesResponse:
        """The instances with whose view they are (leader_id, answered_by)."""
        return await self._call(self._admin.ListInstances, manager_pb2.ListInstancesRequest(),
                                metadata=_forwarded(is_forwarded))

    async def list_requests(self, instance_id: str = "") -> list[instance_pb2.RequestInfo]:
        reply = await self._call(self._admin.ListRequests, manager_pb2.AdminListRequestsRequest(instance_id=instance_id))
        return list(reply.requests)

    async def get_cluster_status(self, is_forwarded: bool = False) -> manager_pb2.GetClusterStatusResponse:
        return await self._call(self._admin.GetClusterStatus, manager_pb2.GetClusterStatusRequest(),
                                metadata=_forwarded(is_forwarded))

    async def get_policy(self) -> str:
        return (await self._call(self._admin.GetPolicy, manager_pb2.GetPolicyRequest())).dispatch

    async def set_policy(self, dispatch: str) -> str:
        return (await self._call(self._admin.SetPolicy, manager_pb2.Policy(dispatch=dispatch))).dispatch

    async def update_policy(self, **fields) -> manager_pb2.Policy:
        """SetPolicy with only `fields` set (manager_pb2.Policy names); the others keep their value."""
        return await self._call(self._admin.SetPolicy, manager_pb2.Policy(**fields))

    async def get_full_policy(self) -> manager_pb2.Policy:
        return await self._call(self._admin.GetPolicy, manager_pb2.GetPolicyRequest())

    async def drain(self, instance_id: str, is_forwarded: bool = False) -> manager_pb2.DrainResponse:
        return await self._call(self._admin.Drain, manager_pb2.DrainRequest(instance_id=instance_id),
                                metadata=_forwarded(is_forwarded))

    async def undrain(self, instance_id: str, is_forwarded: bool = False) -> manager_pb2.DrainResponse:
        return await self._call(self._admin.Undrain, manager_pb2.UndrainRequest(instance_id=instance_id),
                                metadata=_forwarded(is_forwarded))

    async def migrate(self, request_id: str = "", src_instance_id: str = "", dst_instance_id: str = "",
                      timeout_s: float = 60.0, is_forwarded: bool = False) -> manager_pb2.MigrateResponse:
        request = manager_pb2.MigrateRequest(request_id=request_id, src_instance_id=src_instance_id,
                                             dst_instance_id=dst_instance_id)
        return await self._call(self._admin.Migrate, request, timeout_s, _forwarded(is_forwarded))

    async def list_migrations(self, instance_id: str = "", request_id: str = "",
                              is_forwarded: bool = False) -> manager_pb2.ListMigrationsResponse:
        request = manager_pb2.ListMigrationsRequest(instance_id=instance_id, request_id=request_id)
        return await self._call(self._admin.ListMigrations, request, metadata=_forwarded(is_forwarded))

    async def _call(self, method, request, timeout_s: float | None = None, metadata=()):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s,
                                metadata=(*self._auth, *metadata) or None)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None


def _forwarded(is_forwarded: bool) -> tuple[tuple[str, str], ...]:
    return ((FORWARDED_KEY, "1"),) if is_forwarded else ()
