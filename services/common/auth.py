"""Token authentication of gRPC calls: the admin API's bearer token, the cluster token.

A `TokenScheme` says where a call carries its token and what a refused caller is told:
the admin API wants `authorization: Bearer <token>` metadata (`bearer_metadata`), ferry's
internal services `ferry-cluster-token: <token>` (services.common.cluster_token). The
server interceptor guards only the services it is given: health checking and reflection
stay open so load balancers and grpcurl's `list` work without credentials.

| caller sends                        | status            |
|-------------------------------------|-------------------|
| no metadata under the scheme's key  | UNAUTHENTICATED   |
| a malformed value                   | UNAUTHENTICATED   |
| a wrong token                       | PERMISSION_DENIED |

Tokens are compared in constant time and never logged. A refusal is logged as `rpc_unauthenticated`,
at most once per (method, code) per 10 s, with the number of refusals not logged since (`suppressed`).
"""

from __future__ import annotations

import hmac
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog

from services.common.log_sampling import LogSampler
from services.common.rpc_handler import Behavior

log = structlog.get_logger(__name__)

AUTHORIZATION_KEY = "authorization"
_BEHAVIOR_FIELDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")  # "_stream": streams replies


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


@dataclass(frozen=True, slots=True)
class TokenScheme:
    """Where a call carries its token, and what a caller without the right one is told (name the flag)."""

    key: str  # metadata key
    prefix: str  # "Bearer": the value is `Bearer <token>`; "": the value is the token itself
    missing: str  # no metadata under `key`
    malformed: str  # a value that is not `<prefix> <token>` (or is blank)
    wrong: str  # a token that does not match


ADMIN_TOKEN_SCHEME = TokenScheme(
    key=AUTHORIZATION_KEY, prefix="Bearer",
    missing="missing credentials: send `authorization: Bearer <token>` metadata with the manager's --admin-token "
            "(ferryctl --token)",
    malformed="malformed authorization metadata: expected `Bearer <token>`",
    wrong="wrong token: it does not match the manager's --admin-token")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to `services` (full names, e.g. "ferry.v1.AdminService") without the token."""

    def __init__(self, token: str, services: Sequence[str], scheme: TokenScheme = ADMIN_TOKEN_SCHEME) -> None:
        if not token:
            raise ValueError("TokenInterceptor needs a non-empty token")
        self._token = token.encode()
        self._services = frozenset(services)
        self._scheme = scheme
        self._refusal_log = LogSampler()  # a flood of bad callers logs one line per (method, code) per 10 s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if _service_of(method) not in self._services:
            return handler
        denial = self._check(handler_call_details.invocation_metadata)
        if denial is None:
            return handler
        code, message = denial
        # A method the server lacks is the caller's choice of name: one key for all, or a caller cycling names logs each.
        key = (method if handler is not None else None, code)
        if (suppressed := self._refusal_log.admit(key)) is not None:
            log.info("rpc_unauthenticated", method=method, code=code.name, metadata_key=self._scheme.key,
                     suppressed=suppressed)
        return _refusing(handler, code, message)

    def _check(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        scheme = self._scheme
        values = [value for key, value in metadata or () if key == scheme.key]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, scheme.missing
        token = _token_of(str(values[0]), scheme.prefix)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, scheme.malformed
        if not hmac.compare_digest(token.encode(), self._token):
            return grpc.StatusCode.PERMISSION_DENIED, scheme.wrong
        return None


def _token_of(value: str, prefix: str) -> str | None:
    """The token in a metadata value (`<prefix> <token>`, or the token alone), None if malformed."""
    if prefix:
        scheme, _, value = value.partition(" ")
        if scheme.lower() != prefix.lower():
            return None
    return value.strip() or None


def _service_of(method: str) -> str:
    """"/ferry.v1.AdminService/ListInstances" → "ferry.v1.AdminService"."""
    return method.lstrip("/").partition("/")[0]


def _refusing(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
              message: str) -> grpc.RpcMethodHandler | None:
    """`handler` with its behaviour, whatever it is, replaced by a refusal: also a synchronous one, which
    `wrap_rpc_handler` leaves alone (the guard fails closed)."""
    if handler is None:
        return None
    for field in _BEHAVIOR_FIELDS:
        if getattr(handler, field, None) is not None:
            return handler._replace(**{field: _denied(field.endswith("_stream"), code, message)})
    return handler


def _denied(is_streaming: bool, code: grpc.StatusCode, message: str) -> Behavior:
    if is_streaming:
        async def stream_denied(request, context):
            await context.abort(code, message)
            yield  # pragma: no cover — makes this an async generator, like the behaviour it replaces
        return stream_denied

    async def call_denied(request, context):
        await context.abort(code, message)
    return call_denied
