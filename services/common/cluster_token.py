"""The cluster token: a shared secret that ferry's internal gRPC services require.

Off unless set. With `--cluster-token-file FILE` (or `--cluster-token`, or the
FERRY_<SERVICE>_CLUSTER_TOKEN[_FILE] variables) on every ferry process:

* every outbound channel to a ferry service sends `ferry-cluster-token: <token>` metadata
  on every call (`call_interceptors`, one per call shape, installed by `secure_or_insecure_channel`; the token
  travels in `TlsConfig.cluster_token`, which `ClusterTokenKnobs` fills in);
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
                                  f"(`{CLUSTER_TOKEN_KEY}` metadata) and required by this process's gRPC server "
                                  "(the manager's AdminService excepted); empty = off. Prefer --cluster-token-file")
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


def call_interceptors(token: str) -> list[grpc.aio.ClientInterceptor] | None:
    """What a channel to a ferry service needs to send the token on every call (None without a token).
    One interceptor per call shape: grpc.aio files an interceptor under the first shape it implements
    only, so one class implementing all four would leave streams without the token."""
    if not token:
        return None
    return [UnaryUnaryTokenInterceptor(token), UnaryStreamTokenInterceptor(token),
            StreamUnaryTokenInterceptor(token), StreamStreamTokenInterceptor(token)]


class _SendsToken:
    """Adds `ferry-cluster-token: <token>` to a call's metadata (replacing one the caller set)."""

    def __init__(self, token: str) -> None:
        self._pair = (CLUSTER_TOKEN_KEY, token)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(token=***)"

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = [pair for pair in details.metadata or () if pair[0] != CLUSTER_TOKEN_KEY]
        return details._replace(metadata=grpc.aio.Metadata(*pairs, self._pair))


class UnaryUnaryTokenInterceptor(_SendsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class UnaryStreamTokenInterceptor(_SendsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class StreamUnaryTokenInterceptor(_SendsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class StreamStreamTokenInterceptor(_SendsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)
