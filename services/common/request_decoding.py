"""Undecodable request bytes are INVALID_ARGUMENT, not a crash.

grpc.aio deserializes a request before any interceptor's wrapper runs, and a
`DecodeError` there reaches the caller as UNKNOWN. `DecodeInterceptor` takes the
deserializer off the handler and decodes inside the behaviour instead (for client
streams: each message as the servicer reads it), raising `InvalidArgument` that the
`ErrorInterceptor` turns into its status. It is the innermost interceptor, so a caller
is authenticated before its bytes are parsed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidArgument
from services.common.rpc_handler import Behavior, is_async_behavior, is_streaming_behavior

Deserializer = Callable[[bytes], Any]


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = _decoder(handler.request_deserializer)
        if handler.unary_unary is not None and is_async_behavior(handler.unary_unary):
            return handler._replace(request_deserializer=None, unary_unary=_unary_request(handler.unary_unary, decode))
        if handler.unary_stream is not None and is_async_behavior(handler.unary_stream):
            return handler._replace(request_deserializer=None, unary_stream=_unary_request(handler.unary_stream, decode))
        if handler.stream_unary is not None and is_async_behavior(handler.stream_unary):
            return handler._replace(request_deserializer=None, stream_unary=_stream_request(handler.stream_unary, decode))
        if handler.stream_stream is not None and is_async_behavior(handler.stream_stream):
            return handler._replace(request_deserializer=None,
                                    stream_stream=_stream_request(handler.stream_stream, decode))
        return handler


def _decoder(deserialize: Deserializer) -> Deserializer:
    owner = getattr(deserialize, "__self__", None)  # X.FromString is bound to the message class X
    type_name = owner.DESCRIPTOR.full_name if hasattr(owner, "DESCRIPTOR") else "the request type"

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            raise InvalidArgument(f"request cannot be decoded as {type_name} ({exc}); send a serialized "
                                  f"{type_name}") from None
    return decode


def _unary_request(behavior: Behavior, decode: Deserializer) -> Behavior:
    if is_streaming_behavior(behavior):
        async def unary_stream(raw, context):
            async for response in behavior(decode(raw), context):
                yield response
        return unary_stream

    async def unary_unary(raw, context):
        return await behavior(decode(raw), context)
    return unary_unary


def _stream_request(behavior: Behavior, decode: Deserializer) -> Behavior:
    async def decoded(raw_messages) -> AsyncIterator[Any]:
        async for raw in raw_messages:
            yield decode(raw)

    if is_streaming_behavior(behavior):
        async def stream_stream(raw_messages, context):
            async for response in behavior(decoded(raw_messages), context):
                yield response
        return stream_stream

    async def stream_unary(raw_messages, context):
        return await behavior(decoded(raw_messages), context)
    return stream_unary
