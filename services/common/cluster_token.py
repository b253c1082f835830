"""The cluster token: a shared secret that ferry's internal gRPC services require.

Off unless set. With `--cluster-token-file FILE` (or `--cluster-token`, or the
FERRY_<SERVICE>_CLUSTER_TOKEN[_FILE] variables) on every ferry process:

* every outbound channel to a ferry service sends `ferry-cluster-token: <token>` metadata
  on every call (`TokenChannel`, which `secure_or_insecure_channel` wraps its channel in; the token
  travels in `TlsConfig.cluster_token`, which `ClusterTokenKnobs` fills in). A wrapper, not a
  grpc.aio client interceptor: grpc.aio runs an intercepted call in a task of its own, 30-45 µs
  more event-loop CPU per unary call against 8-18 µs for the wrapper's added metadata
  (benchmarks/cluster_token_cost.py);
* every ferry gRPC server refuses calls to its services without it (`server_interceptors`,
  installed by `bind_grpc_server`): UNAUTHENTICATED when missing or blank,
  PERMISSION_DENIED when wrong. Health checking and reflection stay open, and so does the
  manager's AdminService, which has its own --admin-token (operators need only that one).

The token is compared in constant time and never logged, printed or shown in a repr.
It does not cover the gloo/NCCL rendezvous stores (torch TCPStore) of the transfer
services, nor etcd (which has its own users).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from services.common.auth import TokenInterceptor, TokenScheme, read_token
from services.common.config import knob

CLUSTER_TOKEN_KEY = "ferry-cluster-token"
FLAG = "cluster-token"

CLUSTER_TOKEN_SCHEME = TokenScheme(
    key=CLUSTER_TOKEN_KEY, prefix="",
    missing=f"missing cluster token: this ferry service requires `{CLUSTER_TOKEN_KEY}` metadata; start the caller "
            "with the cluster's --cluster-token-file",
    malformed=f"malformed `{CLUSTER_TOKEN_KEY}` metadata: expected the token alone; check the caller's "
              "--cluster-token-file",
    wrong="wrong cluster token: it does not match this service's --cluster-token-file; give every ferry process "
          "the same file")


@dataclasses.dataclass(frozen=True)
class ClusterTokenKnobs:
    """The cluster-token flags of a ferry process that calls or serves internal services (mixed into its config)."""

    cluster_token: str = knob("", "shared secret of ferry's internal gRPC services: sent on every call to them "
                                  f"(`{CLUSTER_TOKEN_KEY}` metadata); empty = off. Prefer --cluster-token-file")
    cluster_token_file: str = knob("", "file holding --cluster-token (one for the whole cluster)")

    @property
    def resolved_cluster_token(self) -> str:
        """--cluster-token, or the contents of --cluster-token-file; ValueError (naming the flag) if unusable."""
        token = read_token(self.cluster_token, self.cluster_token_file, FLAG)
        check_token(token)
        return token


def check_token(token: str) -> None:
    """A gRPC metadata value: printable ASCII, no spaces (never quotes the token)."""
    if any(not 33 <= ord(char) <= 126 for char in token):
        raise ValueError(f"--{FLAG}(-file): the token must be printable ASCII without spaces "
                         "(e.g. `openssl rand -hex 32 > cluster.token`)")


def server_interceptors(token: str, services: Sequence[str]) -> list[grpc.aio.ServerInterceptor]:
    """The guard of `services` (none without a token)."""
    return [TokenInterceptor(token, services, CLUSTER_TOKEN_SCHEME)] if token and services else []


def with_token(channel: grpc.aio.Channel, token: str) -> grpc.aio.Channel:
    """`channel`, sending `token` on every call; as it is without a token."""
    return TokenChannel(channel, token) if token else channel


class TokenChannel(grpc.aio.Channel):
    """A channel whose calls carry `ferry-cluster-token: <token>` (replacing one the caller set): each
    multi-callable it hands out is the wrapped channel's, called with the pair added to its metadata."""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel = channel
        self._pair = (CLUSTER_TOKEN_KEY, token)

    def __repr__(self) -> str:
        return f"TokenChannel({self._channel!r}, token=***)"

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _SendsToken(self._channel.unary_unary(method, request_serializer, response_deserializer,
                                                     _registered_method), self._pair)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _SendsToken(self._channel.unary_stream(method, request_serializer, response_deserializer,
                                                      _registered_method), self._pair)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _SendsToken(self._channel.stream_unary(method, request_serializer, response_deserializer,
                                                      _registered_method), self._pair)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _SendsToken(self._channel.stream_stream(method, request_serializer, response_deserializer,
                                                       _registered_method), self._pair)


class _SendsToken:
    """A multi-callable of any shape, called with the token added to its metadata. Everything after the
    request (or request iterator) is keyword-only, as grpc.aio has it for unary requests: metadata given
    by position would otherwise slip past."""

    __slots__ = ("_call", "_pair")

    def __init__(self, call, pair: tuple[str, str]) -> None:
        self._call = call
        self._pair = pair

    def __repr__(self) -> str:
        return "_SendsToken(token=***)"

    def __call__(self, request=None, *, metadata=None, **kwargs):
        pairs = tuple(pair for pair in metadata or () if pair[0] != CLUSTER_TOKEN_KEY)
        return self._call(request, metadata=(*pairs, self._pair), **kwargs)
