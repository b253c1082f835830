"""One cluster's keys in etcd: `/ferry/<cluster>/<kind>/<id>` names, watches of a kind, and lease-less JSON
reads and writes (`config/*` keys are persistent: `get_json`/`put_json`). The registry (registry.py) adds
this process's membership keys under its lease."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Self

import structlog
from etcd3aio import Etcd3Client, prefix_range_end
from etcd3aio.kv import KVService

from services.common.etcd_client import EtcdAccess, connect_etcd
from services.common.membership import MembershipView

log = structlog.get_logger(__name__)


def cluster_prefix(cluster: str) -> str:
    return f"/ferry/{cluster}/"


class ClusterKeys:
    """An etcd client (connected on first use) on one cluster's keys, and the watches opened through it."""

    def __init__(self, endpoints: Sequence[str], cluster: str, rpc_timeout_s: float,
                 access: EtcdAccess | None = None) -> None:
        self.endpoints = list(endpoints)
        self.access = access  # TLS and auth of the etcd client
        self.cluster = cluster
        self._rpc_timeout_s = rpc_timeout_s
        self._client: Etcd3Client | None = None
        self._views: list[MembershipView] = []

    def key(self, kind: str, member_id: str) -> str:
        return f"{cluster_prefix(self.cluster)}{kind}/{member_id}"

    def prefix(self, kind: str) -> str:
        return f"{cluster_prefix(self.cluster)}{kind}/"

    async def watch(self, kind: str, resync_interval_s: float = 5.0, initial_sync_timeout_s: float = 2.0
                    ) -> MembershipView:
        """A live view of `/ferry/<cluster>/<kind>/`, after its first read (or the timeout)."""
        view = MembershipView(await self._connect(), self.prefix(kind), resync_interval_s, self._rpc_timeout_s)
        view.start()
        self._views.append(view)
        if not await view.wait_synced(initial_sync_timeout_s):
            log.warning("membership_not_synced", prefix=view.prefix, timeout_s=initial_sync_timeout_s)
        return view

    async def read(self, kind: str) -> dict[str, Any]:
        """id → JSON value of everything under `/ferry/<cluster>/<kind>/` now (one read, no watch)."""
        client = await self._connect()
        prefix = self.prefix(kind)
        response = await client.kv.get(prefix, range_end=prefix_range_end(prefix), timeout=self._rpc_timeout_s)
        return {kv.key.decode().removeprefix(prefix): json.loads(kv.value) for kv in response.kvs}

    async def get_json(self, key: str) -> Any | None:
        """Value of `/ferry/<cluster>/<key>` (e.g. key="config/policy"), None if absent."""
        client = await self._connect()
        response = await client.kv.get(cluster_prefix(self.cluster) + key, timeout=self._rpc_timeout_s)
        return json.loads(response.kvs[0].value) if response.kvs else None

    async def delete_json_if(self, key: str, condition: Callable[[Any], bool]) -> bool:
        """Delete `/ferry/<cluster>/<key>` if its JSON value meets `condition`, in one transaction with
        that read (a value written in between stays). False if absent, not JSON, or kept."""
        client = await self._connect()
        full_key = cluster_prefix(self.cluster) + key
        response = await client.kv.get(full_key, timeout=self._rpc_timeout_s)
        if not response.kvs:
            return False
        raw = response.kvs[0].value
        try:
            if not condition(json.loads(raw)):
                return False
        except ValueError:
            return False
        txn = await client.kv.txn(compare=[KVService.txn_compare_value(full_key, raw)],
                                  success=[KVService.txn_op_delete(full_key)], timeout=self._rpc_timeout_s)
        return txn.succeeded

    async def put_json(self, key: str, value: Any) -> None:
        """Persistent (lease-less) put of `/ferry/<cluster>/<key>`."""
        client = await self._connect()
        await client.kv.put(cluster_prefix(self.cluster) + key, json.dumps(value, sort_keys=True),
                            timeout=self._rpc_timeout_s)

    async def _connect(self) -> Etcd3Client:
        if self._client is None:
            self._client = await connect_etcd(self.endpoints, self.access)
        return self._client

    async def _close_views(self) -> None:
        for view in self._views:
            await view.close()

    async def _close_client(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def close(self) -> None:
        """Stop the views and close the client."""
        await self._close_views()
        await self._close_client()

    async def __aenter__(self) -> Self:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
