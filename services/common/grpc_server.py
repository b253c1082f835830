"""Starting a ferry gRPC server and opening channels to one.

Every server gets the same furniture: the request-id and error interceptors (outermost
first), the cluster-token guard of its services (but `token_open_services`) when
`tls.cluster_token` is set, the caller's own, then the decode interceptor (undecodable
bytes: INVALID_ARGUMENT), `grpc.health.v1` for "" and each service, server reflection (so
grpcurl works without .proto files), 64 MiB messages and keepalive settings that match
`secure_or_insecure_channel`. Port 0 picks a free port; `GrpcServer.port` is the bound one.
With a `TlsConfig` that has a certificate the port serves TLS (mTLS with a client CA);
clients dial with `secure_or_insecure_channel(address, tls)`, TLS when `tls.ca_file` is set,
sending `tls.cluster_token` on every call when it is set.

Shutdown order (STYLE.md): `await server.set_serving(False)` → revoke the etcd lease →
`await server.stop(grace)` → cancel tasks → close channels.
"""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.common import cluster_token
from services.common.errors import ErrorInterceptor
from services.common.logging import RequestIdInterceptor
from services.common.peer_address import host_port
from services.common.ports import bind_error
from services.common.request_decoding import DecodeInterceptor
from services.common.startup import StartupError
from services.common.tls import TlsConfig, make_channel_credentials, make_server_credentials

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

AddServicerFn = Callable[[Any, grpc.aio.Server], None]

MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Both ends ping every KEEPALIVE_TIME_S and drop a connection whose ping goes unanswered
# for KEEPALIVE_TIMEOUT_S. A peer that is frozen (SIGSTOP, a hung host) or cut off by a
# network that drops packets still looks connected to TCP; without pings a stream to it
# would hang until its deadline. With them its streams fail UNAVAILABLE within 10 s, and
# the frontend resumes them elsewhere (instance frozen), or the instance aborts them and
# frees their blocks (frontend frozen). Pings are answered by gRPC's own threads, so a
# busy engine or a held GIL does not trip them.
KEEPALIVE_TIME_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0
KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    # Current gRPC core waits for a ping's answer ping_timeout_ms (default 60 s), whatever
    # keepalive_timeout_ms says (grpc/grpc#34647): a frozen peer took 60 s to be found.
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *MESSAGE_OPTIONS,
    *KEEPALIVE_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),  # a restarted peer is found again quickly
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# For connections that carry bulk bytes (KV blocks between transfer services): read the
# socket in large chunks. grpc's default adapts up from small reads, which costs a
# syscall and a slice per few KiB; with these a bare grpc-python stream of 1 MiB
# messages went from 1.0 to 1.3-1.5 GB/s on loopback here. Not for every connection:
# each read can hold a buffer this large.
BULK_TRANSFER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *MESSAGE_OPTIONS,
    ("grpc.so_reuseport", 0),  # two servers on one fixed port must fail, not share it
    *KEEPALIVE_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000) // 2),  # clients ping every 5 s
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclasses.dataclass(slots=True)
class GrpcServer:
    """A started server: its bound port, its health status, its shutdown."""

    server: grpc.aio.Server
    host: str
    port: int
    advertise_host: str
    service_full_names: tuple[str, ...]
    health: HealthServicer
    tls_mode: str = "off"
    is_stopped: bool = False

    @property
    def address(self) -> str:
        """`host:port` that other processes dial (wildcard binds advertise 127.0.0.1; IPv6 in brackets)."""
        return host_port(self.advertise_host, self.port)

    async def set_serving(self, is_serving: bool) -> None:
        """Health status for "" and every service: SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_full_names):
            await self.health.set(name, status)

    async def start(self, servicers: Sequence[tuple[AddServicerFn, Any]]) -> None:
        """Register `servicers`, health (for "" and each service) and reflection; start; SERVING."""
        for add_fn, servicer in servicers:
            add_fn(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_full_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.server.start()
        await self.set_serving(True)
        log.info("grpc_server_started", address=self.address, services=list(self.service_full_names),
                 tls=self.tls_mode)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, then stop accepting calls and wait up to `grace` s for running ones (once:
        a later call returns at once, so a `finally` may stop a server the normal path stopped)."""
        if self.is_stopped:
            return
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.is_stopped = True  # only now: a stop cut short leaves the `finally`'s to finish it
        log.info("grpc_server_stopped", address=self.address)


async def start_grpc_server(host: str, port: int, servicers: Sequence[tuple[AddServicerFn, Any]],
                            service_full_names: Sequence[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                            advertise_host: str | None = None, tls: TlsConfig | None = None,
                            options: Sequence[tuple[str, Any]] = ()) -> GrpcServer:
    """Build, bind and start a server (TLS if `tls` has a certificate); health is SERVING when this returns.
    Extra `options` override ferry's defaults."""
    grpc_server = bind_grpc_server(host, port, service_full_names, interceptors, advertise_host, tls, options)
    await grpc_server.start(servicers)
    return grpc_server


def bind_grpc_server(host: str, port: int, service_full_names: Sequence[str],
                     interceptors: Sequence[grpc.aio.ServerInterceptor] = (), advertise_host: str | None = None,
                     tls: TlsConfig | None = None, options: Sequence[tuple[str, Any]] = (),
                     token_open_services: Sequence[str] = ()) -> GrpcServer:
    """A bound server not started yet: for a service whose servicers need its port or address
    (`GrpcServer.start` registers them; gRPC takes no handlers once started). With a cluster
    token every service requires it, but `token_open_services` (which guard themselves)."""
    guarded = [name for name in service_full_names if name not in token_open_services]
    guard = cluster_token.server_interceptors(tls.cluster_token, guarded) if tls is not None else []
    server = grpc.aio.server(
        interceptors=[RequestIdInterceptor(), ErrorInterceptor(), *guard, *interceptors, DecodeInterceptor()],
        options=_merged(SERVER_OPTIONS, options))
    bound_port = _bind(server, host, port, make_server_credentials(tls) if tls is not None else None)
    return GrpcServer(server=server, host=host, port=bound_port, advertise_host=advertise_host or _advertise(host),
                      service_full_names=tuple(service_full_names), health=HealthServicer(), tls_mode=_tls_mode(tls))


def insecure_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A plaintext channel with ferry's message limits and keepalive; extra `options` override the defaults."""
    return secure_or_insecure_channel(address, None, options)


def secure_or_insecure_channel(address: str, tls: TlsConfig | None,
                               options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A channel with ferry's options: TLS when `tls.ca_file` is set (mTLS if we have a certificate);
    every call carries `tls.cluster_token` when it is set."""
    merged = _merged(CHANNEL_OPTIONS, options)
    token = tls.cluster_token if tls is not None else ""
    if tls is None or not tls.is_client_tls:
        return cluster_token.with_token(grpc.aio.insecure_channel(address, options=merged), token)
    if tls.server_name:
        merged.append(("grpc.ssl_target_name_override", tls.server_name))
    return cluster_token.with_token(grpc.aio.secure_channel(address, make_channel_credentials(tls), options=merged),
                                    token)


def _is_in_use(host: str, port: int) -> bool:
    error = bind_error(host, port)
    return error is not None and error.errno == errno.EADDRINUSE  # other errors: gRPC says what is wrong


def _tls_mode(tls: TlsConfig | None) -> str:
    if tls is None or not tls.is_server_tls:
        return "off"
    return "mtls" if tls.client_ca_file else "tls"


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    target = host_port(host, port)
    if port and _is_in_use(host, port):  # say so plainly (gRPC's own words are a C log line and "set GRPC_VERBOSITY")
        raise StartupError(f"cannot bind gRPC server to {target}: the port is already in use (another ferry process "
                           "or program holds it); pick another --port or --host")
    try:
        if credentials is None:
            bound_port = server.add_insecure_port(target)
        else:
            bound_port = server.add_secure_port(target, credentials)
    except RuntimeError as exc:
        raise StartupError(f"cannot bind gRPC server to {target}: {exc}; pick another --port or --host") from exc
    if bound_port == 0:
        raise StartupError(f"cannot bind gRPC server to {target}: address in use or invalid; "
                           "pick another --port or --host")
    return bound_port


def _advertise(host: str) -> str:
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def _merged(defaults: Sequence[tuple[str, Any]], overrides: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    overridden = {name for name, _ in overrides}
    return [opt for opt in defaults if opt[0] not in overridden] + list(overrides)
