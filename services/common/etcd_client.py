"""The etcd3aio client as ferry uses it: bounded calls, fast reconnects, one lease helper.

Every call passes `timeout=`; etcd3aio bounds the whole call (its own retries included)
by it and raises `TimeoutError`. `ETCD_ERRORS` is what a call can raise when etcd is
unreachable, slow, or refuses; retry loops catch exactly that.

TLS and authentication come from `EtcdAccess` (each service config mixes in `EtcdKnobs`:
--etcd-ca, --etcd-cert, --etcd-key, --etcd-server-name, --etcd-user, --etcd-password or
--etcd-password-file). With a user the client authenticates when it connects and again
every `TOKEN_REFRESH_S` (etcd's simple tokens expire, and die with an etcd restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
from etcd3aio import Etcd3Client, EtcdError

from services.common.auth import read_token
from services.common.config import knob
from services.common.error_text import error_text
from services.common.etcd_endpoints import check_address_flag, resolve_endpoints, single_host_name
from services.common.ids import check_cluster_flag
from services.common.periodic import periodic_loop

log = structlog.get_logger(__name__)

ETCD_ERRORS: tuple[type[BaseException], ...] = (EtcdError, grpc.aio.AioRpcError, TimeoutError)
DEFAULT_RPC_TIMEOUT_S = 2.0
TOKEN_REFRESH_S = 30.0

# etcd3aio's channel keeps gRPC's default reconnect backoff (up to 120 s); a restarted etcd
# must be found again within a lease TTL.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


@dataclasses.dataclass(frozen=True, slots=True)
class EtcdAccess:
    """How to reach etcd securely: TLS files (PEM paths) and a user; empty = off."""

    ca_file: str = ""  # set = TLS, verifying etcd against this CA
    cert_file: str = ""  # client certificate (etcd --client-cert-auth)
    key_file: str = ""
    server_name: str = ""  # name expected in etcd's certificate, when it differs from the host dialed
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)

    def check(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--etcd-cert and --etcd-key go together; set both or neither")
        if self.cert_file and not self.ca_file:
            raise ValueError("--etcd-cert needs --etcd-ca (client certificates only travel over TLS)")
        for flag, path in (("--etcd-ca", self.ca_file), ("--etcd-cert", self.cert_file),
                           ("--etcd-key", self.key_file)):
            if path and not pathlib.Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.password and not self.user:
            raise ValueError("--etcd-password needs --etcd-user")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Etcd3Client` for the TLS part."""
        if not self.ca_file:
            return {}
        read = lambda path: pathlib.Path(path).read_bytes() if path else None  # noqa: E731
        return {"ca_cert": read(self.ca_file), "cert_chain": read(self.cert_file), "cert_key": read(self.key_file),
                "tls_server_name": self.server_name or None}


@dataclasses.dataclass(frozen=True)
class EtcdKnobs:
    """etcd TLS and auth flags of a service (mixed into its config dataclass)."""

    etcd_ca: str = knob("", "PEM CA bundle that verifies etcd; set = TLS to etcd")
    etcd_cert: str = knob("", "PEM client certificate for etcd (when etcd runs with --client-cert-auth)")
    etcd_key: str = knob("", "PEM private key of --etcd-cert")
    etcd_server_name: str = knob("", "name expected in etcd's certificate when it differs from the host dialed")
    etcd_user: str = knob("", "etcd user (etcd auth enabled); empty = no authentication")
    etcd_password: str = knob("", "password of --etcd-user (prefer --etcd-password-file: a flag shows in ps)")
    etcd_password_file: str = knob("", "file holding the password of --etcd-user")

    @property
    def etcd_access(self) -> EtcdAccess:
        return EtcdAccess(ca_file=self.etcd_ca, cert_file=self.etcd_cert, key_file=self.etcd_key,
                          server_name=self.etcd_server_name, user=self.etcd_user,
                          password=read_token(self.etcd_password, self.etcd_password_file, "etcd-password"))


@dataclasses.dataclass(frozen=True)
class EtcdStartupKnobs:
    """How long a service that registers in etcd waits for it at startup, and the check of its etcd flags
    (mixed into its config)."""

    etcd_wait_s: float = knob(60.0, "at startup, how long to wait for etcd to answer before exiting 1 (0: at "
                                    "once); a service that loses etcd later keeps running and re-registers")

    def check_etcd_flags(self, cluster: str, etcd_endpoints: Sequence[str]) -> None:
        """--cluster, --etcd-endpoints (each service declares them, with its own default and help) and
        --etcd-wait-s; a ValueError naming the first flag that is off."""
        check_cluster_flag(cluster)
        check_address_flag("--etcd-endpoints", etcd_endpoints)
        if not 0 <= self.etcd_wait_s <= 86400:
            raise ValueError(f"--etcd-wait-s must be 0..86400 seconds, got {self.etcd_wait_s}")


class _AuthenticatedClient(Etcd3Client):
    """An Etcd3Client that re-authenticates every TOKEN_REFRESH_S until it is closed."""

    _refresh_task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
            self._refresh_task = None
        await super().close()


async def connect_etcd(endpoints: Sequence[str], access: EtcdAccess | None = None) -> Etcd3Client:
    """An etcd client on `endpoints` ("host:port", names resolved to IPv4 now); TLS and auth from `access`.

    Without a user the channel connects lazily; with one, this authenticates at once and
    raises one of ETCD_ERRORS if etcd does not answer or refuses the credentials.
    """
    if not endpoints:
        raise ValueError("no etcd endpoints; set --etcd-endpoints (e.g. 127.0.0.1:2379)")
    access = access or EtcdAccess()
    if access.ca_file and not access.server_name and (name := single_host_name(endpoints)):
        access = dataclasses.replace(access, server_name=name)  # dialed by address: check the cert for the name
    cls = _AuthenticatedClient if access.user else Etcd3Client
    client = cls(await resolve_endpoints(endpoints), watch_reconnect_backoff_seconds=0.1,
                 watch_max_reconnect_backoff_seconds=1.0, **access.client_kwargs())
    client._manager.grpc_options.extend(_RECONNECT_OPTIONS)  # no public hook for channel options
    await client.connect()
    if access.user:
        try:
            await _authenticate(client, access)
        except BaseException:
            await client.close()
            raise
        client._refresh_task = asyncio.create_task(_token_refresh_loop(client, access), name="etcd_token_refresh_loop")
    return client


async def _authenticate(client: Etcd3Client, access: EtcdAccess) -> None:
    response = await client.auth.authenticate(access.user, access.password, timeout=DEFAULT_RPC_TIMEOUT_S)
    client.set_token(response.token)


async def _token_refresh_loop(client: Etcd3Client, access: EtcdAccess, interval_s: float = TOKEN_REFRESH_S) -> None:
    """Re-authenticate on a timer: tokens expire, and an etcd restart forgets them."""
    await periodic_loop("etcd_token_refresh_loop", interval_s, lambda: _refresh_token(client, access))


async def _refresh_token(client: Etcd3Client, access: EtcdAccess) -> None:
    try:
        await _authenticate(client, access)
    except ETCD_ERRORS as exc:  # the old token serves until it expires; try again next interval
        log.warning("etcd_authentication_failed", user=access.user, error=error_text(exc))


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
