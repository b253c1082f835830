"""An exception as one line of a log field or an error message. Many carry no message (a TimeoutError
from `asyncio.wait_for`), and `str()` of those is empty: "etcd did not store the mark (); retry".
`repr()` is no better: "cannot register ... in etcd: EtcdConnectionError('KV.Txn failed ...')". A gRPC
call's error (`grpc.aio.AioRpcError`) prints as a multi-line `<AioRpcError of RPC ...>`: it reads as
its status code and details ("UNAVAILABLE: failed to connect to all addresses")."""

from __future__ import annotations

import grpc


def error_text(exc: BaseException) -> str:
    """The exception's message, or its type's name where it has none."""
    return _message(exc) or type(exc).__name__


def typed_error_text(exc: BaseException) -> str:
    """`Type: message`, or the type's name alone where it has no message."""
    message = _message(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _message(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}" if exc.details() else exc.code().name
    return str(exc)
