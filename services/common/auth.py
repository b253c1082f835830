"""Bearer-token authentication of gRPC calls (the admin API).

A client sends `authorization: Bearer <token>` metadata (`bearer_metadata`). The server
interceptor guards only the services it is given: health checking and reflection stay
open so load balancers and grpcurl's `list` work without credentials.

| caller sends                 | status            |
|------------------------------|-------------------|
| no `authorization` metadata  | UNAUTHENTICATED   |
| a malformed header           | UNAUTHENTICATED   |
| `Bearer <wrong token>`       | PERMISSION_DENIED |

Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import pathlib
from collections.abc import Sequence

import grpc
import structlog

from services.common.rpc_handler import Behavior, is_streaming_behavior, wrap_rpc_handler

log = structlog.get_logger(__name__)

AUTHORIZATION_KEY = "authorization"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates a call with `token` (empty when there is no token)."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def read_token(token: str, token_file: str, flag: str) -> str:
    """The token given inline, or read from `token_file` (surrounding whitespace stripped)."""
    if token and token_file:
        raise ValueError(f"set --{flag} or --{flag}-file, not both")
    if not token_file:
        return token
    try:
        text = pathlib.Path(token_file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--{flag}-file {token_file}: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"--{flag}-file {token_file} is empty")
    return text


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to `services` (full names, e.g. "ferry.v1.AdminService") without the token."""

    def __init__(self, token: str, services: Sequence[str]) -> None:
        if not token:
            raise ValueError("BearerTokenInterceptor needs a non-empty token")
        self._token = token.encode()
        self._services = frozenset(services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if _service_of(method) not in self._services:
            return handler
        denial = self._check(handler_call_details.invocation_metadata)
        if denial is None:
            return handler
        code, message = denial
        log.info("rpc_unauthenticated", method=method, code=code.name)
        return wrap_rpc_handler(handler, lambda behavior: _denied(behavior, code, message))

    def _check(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        values = [value for key, value in metadata or () if key == AUTHORIZATION_KEY]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, (
                "missing credentials: send `authorization: Bearer <token>` metadata with the manager's "
                "--admin-token (ferryctl --token)")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "malformed authorization metadata: expected `Bearer <token>`"
        if not hmac.compare_digest(token.strip().encode(), self._token):
            return grpc.StatusCode.PERMISSION_DENIED, "wrong token: it does not match the manager's --admin-token"
        return None


def _service_of(method: str) -> str:
    """"/ferry.v1.AdminService/ListInstances" → "ferry.v1.AdminService"."""
    return method.lstrip("/").partition("/")[0]


def _denied(behavior: Behavior, code: grpc.StatusCode, message: str) -> Behavior:
    if is_streaming_behavior(behavior):
        async def stream_denied(request, context):
            await context.abort(code, message)
            yield  # pragma: no cover — makes this an async generator, like the behaviour it replaces
        return stream_denied

    async def call_denied(request, context):
        await context.abort(code, message)
    return call_denied
