"""Wrapping the behaviours of a grpc.aio method handler, shared by ferry's server interceptors.

A server interceptor in grpc.aio gets the handler before the call runs, in a different
task than the handler itself. Anything that must hold *during* the call (a bound
`request_id`, an error mapping) has to wrap the behaviour, which this module does for
all four RPC shapes. Async-generator behaviours stay async generators and coroutine
behaviours stay coroutines, because grpc.aio picks the streaming API from that shape.
Synchronous behaviours are left alone (ferry servicers are all `async`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
BehaviorWrapper = Callable[[Behavior], Behavior]

_BEHAVIOR_FIELDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def wrap_rpc_handler(handler: grpc.RpcMethodHandler | None, wrap: BehaviorWrapper) -> grpc.RpcMethodHandler | None:
    """Return `handler` with its behaviour replaced by `wrap(behaviour)`."""
    if handler is None:
        return None
    for field in _BEHAVIOR_FIELDS:
        behavior = getattr(handler, field, None)
        if behavior is not None and is_async_behavior(behavior):
            return handler._replace(**{field: wrap(behavior)})
    return handler


def is_async_behavior(behavior: Behavior) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def is_streaming_behavior(behavior: Behavior) -> bool:
    return inspect.isasyncgenfunction(behavior)
