"""The etcd3aio client as ferry uses it: bounded calls, fast reconnects, one lease helper.

Every call passes `timeout=`; etcd3aio bounds the whole call (its own retries included)
by it and raises `TimeoutError`. `ETCD_ERRORS` is what a call can raise when etcd is
unreachable, slow, or refuses; retry loops catch exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Sequence

import grpc
from etcd3aio import Etcd3Client, EtcdError

ETCD_ERRORS: tuple[type[BaseException], ...] = (EtcdError, grpc.aio.AioRpcError, TimeoutError)
DEFAULT_RPC_TIMEOUT_S = 2.0

# etcd3aio's channel keeps gRPC's default reconnect backoff (up to 120 s); a restarted etcd
# must be found again within a lease TTL.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


async def connect_etcd(endpoints: Sequence[str]) -> Etcd3Client:
    """An etcd client on `endpoints` ("host:port"); the channel connects lazily."""
    if not endpoints:
        raise ValueError("no etcd endpoints; set --etcd-endpoints (e.g. 127.0.0.1:2379)")
    client = Etcd3Client(list(endpoints), watch_reconnect_backoff_seconds=0.1,
                         watch_max_reconnect_backoff_seconds=1.0)
    client._manager.grpc_options.extend(_RECONNECT_OPTIONS)  # no public hook for channel options
    await client.connect()
    return client


@dataclasses.dataclass(slots=True)
class Lease:
    """An etcd lease: grant, renew one step at a time, revoke."""

    client: Etcd3Client
    lease_id: int
    ttl_s: int  # as granted by etcd (whole seconds, at least its minimum TTL)
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S

    @classmethod
    async def grant(cls, client: Etcd3Client, ttl_s: float, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> Lease:
        response = await client.lease.grant(ttl=max(1, math.ceil(ttl_s)), timeout=rpc_timeout_s)
        return cls(client, int(response.ID), int(response.TTL), rpc_timeout_s)

    async def keepalive(self) -> bool:
        """Renew once. True if the lease is alive, False if etcd says it expired or was revoked.

        Raises one of ETCD_ERRORS if etcd does not answer within `rpc_timeout_s`.
        """
        call = self.client.lease.keep_alive(self.lease_id)
        try:
            async with asyncio.timeout(self.rpc_timeout_s):
                async for response in call:
                    return response.TTL > 0
        finally:
            call.cancel()
        raise EtcdError(f"lease {self.lease_id:x}: keepalive stream ended without an answer")

    async def revoke(self) -> None:
        """Revoke (deleting every key attached); a lease that is already gone is fine."""
        with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: expired or revoked already
            await self.client.lease.revoke(self.lease_id, timeout=self.rpc_timeout_s)
