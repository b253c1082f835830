"""A small protobuf fuzzer for ferry's gRPC services: random bytes, truncated messages and
messages with hostile field values (negative counts, unknown enums, empty and huge
strings, oversized lists, NaN), sent as raw bytes through generic channel calls.

`fuzz_service` calls every method of a service and returns what came back, so a test
can assert that nothing answered INTERNAL/UNKNOWN (a crash) and that undecodable bytes
got INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

CRASH_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
_FD = pb_descriptor.FieldDescriptor
_INT_EDGES = {
    _FD.TYPE_INT32: (0, 1, -1, 7, 2**31 - 1, -(2**31)),
    _FD.TYPE_SINT32: (0, 1, -1, 2**31 - 1, -(2**31)),
    _FD.TYPE_SFIXED32: (0, -1, 2**31 - 1),
    _FD.TYPE_UINT32: (0, 1, 7, 2**32 - 1),
    _FD.TYPE_FIXED32: (0, 2**32 - 1),
    _FD.TYPE_INT64: (0, 1, -1, 2**63 - 1, -(2**63)),
    _FD.TYPE_SINT64: (0, -1, 2**63 - 1),
    _FD.TYPE_SFIXED64: (0, -1, 2**63 - 1),
    _FD.TYPE_UINT64: (0, 1, 2**64 - 1),
    _FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = (0.0, -1.0, 1.0, 0.5, 1e30, -1e30, math.inf, -math.inf, math.nan)
_STRINGS = ("", "x", "a" * 5000, "../../etc/passwd", "\x00\x01", "インスタンス", "127.0.0.1:1", "both", "grpc", "load")


@dataclass(frozen=True, slots=True)
class Outcome:
    method: str
    kind: str  # random_bytes | truncated | hostile
    is_decodable: bool  # whether the bytes parse as the request message at all
    code: grpc.StatusCode
    details: str


def random_message(descriptor: pb_descriptor.Descriptor, rng: random.Random, depth: int = 0):
    """A message of `descriptor` with random, often hostile, field values."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if rng.random() < 0.35:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            _fill_map(message, field, rng, depth)
        elif field.is_repeated:
            count = rng.choice((0, 1, 3, rng.randint(500, 3000)))
            target = getattr(message, field.name)
            for _ in range(count):
                if field.type == _FD.TYPE_MESSAGE:
                    if depth < 3:
                        target.add().CopyFrom(random_message(field.message_type, rng, depth + 1))
                else:
                    target.append(_scalar(field, rng))
        elif field.type == _FD.TYPE_MESSAGE:
            if depth < 3:
                getattr(message, field.name).CopyFrom(random_message(field.message_type, rng, depth + 1))
        else:
            setattr(message, field.name, _scalar(field, rng))
    return message


def _fill_map(message, field, rng: random.Random, depth: int) -> None:
    key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    target = getattr(message, field.name)
    for _ in range(rng.choice((0, 1, 3))):
        key = _scalar(key_field, rng)
        if value_field.type == _FD.TYPE_MESSAGE:
            target[key].CopyFrom(random_message(value_field.message_type, rng, depth + 1))
        else:
            target[key] = _scalar(value_field, rng)


def _scalar(field, rng: random.Random):
    kind = field.type
    if kind in _INT_EDGES:
        edges = _INT_EDGES[kind]
        return rng.choice(edges) if rng.random() < 0.7 else rng.randint(min(edges), max(edges))
    if kind in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-100, 100)
    if kind == _FD.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == _FD.TYPE_STRING:
        return rng.choice(_STRINGS)
    if kind == _FD.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 64, 4096)))
    if kind == _FD.TYPE_ENUM:
        return rng.choice((-1, 0, 1, 2, 3, 99, *(v.number for v in field.enum_type.values)))
    raise TypeError(f"unhandled field type {kind}")


def payloads(descriptor: pb_descriptor.Descriptor, rng: random.Random, num_each: int) -> list[tuple[str, bytes]]:
    """(kind, bytes) to send as one request message."""
    out = []
    for _ in range(num_each):
        out.append(("random_bytes", rng.randbytes(rng.randint(1, 200))))
    for _ in range(num_each):
        data = random_message(descriptor, rng).SerializeToString()
        if len(data) > 1:
            out.append(("truncated", data[:rng.randint(1, len(data) - 1)]))
    for _ in range(num_each):
        out.append(("hostile", random_message(descriptor, rng).SerializeToString()))
    return out


async def call_raw(channel: grpc.aio.Channel, method: pb_descriptor.MethodDescriptor, data: bytes,
                   timeout_s: float, metadata: Sequence[tuple[str, str]] = ()) -> tuple[grpc.StatusCode, str]:
    """Send `data` as the request (one message, also for client streams); read any response stream."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kwargs = dict(request_serializer=None, response_deserializer=None)
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kwargs)(iter([data]), timeout=timeout_s, metadata=metadata)
            async for _ in call:
                pass
        elif method.client_streaming:
            await channel.stream_unary(path, **kwargs)(iter([data]), timeout=timeout_s, metadata=metadata)
        elif method.server_streaming:
            call = channel.unary_stream(path, **kwargs)(data, timeout=timeout_s, metadata=metadata)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(path, **kwargs)(data, timeout=timeout_s, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _parses(request_type, data: bytes) -> bool:
    try:
        request_type.FromString(data)
    except DecodeError:
        return False
    return True


async def fuzz_service(channel: grpc.aio.Channel, service: pb_descriptor.ServiceDescriptor, rng: random.Random,
                       num_each: int, timeout_s: float = 5.0, skip: Sequence[str] = (),
                       metadata: Sequence[tuple[str, str]] = ()) -> list[Outcome]:
    outcomes = []
    for method in service.methods:
        if method.name in skip:
            continue
        request_type = message_factory.GetMessageClass(method.input_type)
        for kind, data in payloads(method.input_type, rng, num_each):
            code, details = await call_raw(channel, method, data, timeout_s, metadata)
            outcomes.append(Outcome(f"{service.name}/{method.name}", kind, _parses(request_type, data), code, details))
        await asyncio.sleep(0)
    return outcomes
