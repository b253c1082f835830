"""Reference figures for benchmarks/migration_speed.py, measured in the same run at the same sizes.

A raw TCP socket between two processes (preallocated buffers, sendall/recv_into); bare gloo between two
processes (torch.distributed send/recv of preallocated buffers in chunks of the services' staging size,
over as many connections and with as many chunks in flight as the services use: gloo's own ceiling, with
no gather, scatter or RPC); a bare grpc-python stream between two processes (one bytes message per grpc
chunk, the same channel options, received and dropped: grpc's own ceiling); and one memcpy. Each sink
runs in a spawned process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import multiprocessing
import socket
import struct
import time

import grpc
import torch
import torch.distributed as dist

from services.common.etcd_launcher import free_port
from services.common.grpc_server import BULK_TRANSFER_OPTIONS, MESSAGE_OPTIONS, insecure_channel
from services.common.heap import keep_freed_heap
from services.transfer.pair_channel import chunk_tag


def _tcp_sink(port: int, max_bytes: int) -> None:
    buffer = bytearray(max_bytes)
    view = memoryview(buffer)
    with socket.create_server(("127.0.0.1", port)) as server:
        conn, _ = server.accept()
        with conn:
            while header := conn.recv(8, socket.MSG_WAITALL):
                (size,) = struct.unpack("!Q", header)
                received = 0
                while received < size:
                    received += conn.recv_into(view[received:size])
                conn.sendall(b"k")


class TcpReference:
    def __init__(self, max_bytes: int) -> None:
        self._port = free_port()
        self._buffer = memoryview(bytearray(max_bytes))
        self._process = multiprocessing.get_context("spawn").Process(target=_tcp_sink, args=(self._port, max_bytes),
                                                                    daemon=True)
        self._sock: socket.socket | None = None  # until connected

    def launch(self) -> None:
        """Start the sink process (it takes a few seconds to import); `connect` waits for it."""
        self._process.start()

    def connect(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self._sock = socket.create_connection(("127.0.0.1", self._port))
                return
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send_s(self, num_bytes: int) -> float:
        started = time.perf_counter()
        self._sock.sendall(struct.pack("!Q", num_bytes))
        self._sock.sendall(self._buffer[:num_bytes])
        self._sock.recv(1)
        return time.perf_counter() - started

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        elif self._process.is_alive():  # never connected
            self._process.kill()
        self._process.join(10)


def _gloo_pair(port: int, rank: int, num_connections: int) -> dist.ProcessGroupGloo:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") for _ in range(num_connections)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _chunks(num_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_bytes, num_bytes)) for start in range(0, num_bytes, chunk_bytes)]


def _move_chunks(group: dist.ProcessGroupGloo, buffer: torch.Tensor, num_bytes: int, chunk_bytes: int,
                 in_flight: int, is_sender: bool) -> None:
    """Send or receive `num_bytes` in chunks, `in_flight` at a time, each with its own tag (as the services do)."""
    pending = []
    for index, (start, stop) in enumerate(_chunks(num_bytes, chunk_bytes)):
        if len(pending) == in_flight:
            pending.pop(0).wait()
        move = group.send if is_sender else group.recv
        pending.append(move([buffer[start:stop]], 1 - group.rank(), chunk_tag(1, index)))
    for work in pending:
        work.wait()


def _gloo_sink(port: int, max_bytes: int, chunk_bytes: int, num_connections: int, in_flight: int) -> None:
    group = _gloo_pair(port, 1, num_connections)
    buffer = torch.zeros(max_bytes, dtype=torch.uint8)
    size = torch.zeros(1, dtype=torch.int64)
    while True:
        group.recv([size], 0, 0).wait()
        if size.item() == 0:
            return
        _move_chunks(group, buffer, size.item(), chunk_bytes, in_flight, is_sender=False)
        group.send([size], 0, 0).wait()


class GlooReference:
    """Bare gloo: this process sends chunks of a preallocated buffer to a sink process."""

    def __init__(self, max_bytes: int, chunk_bytes: int, num_connections: int, in_flight: int) -> None:
        self._port = free_port()
        self._chunk_bytes = chunk_bytes
        self._num_connections = num_connections
        self._in_flight = in_flight
        self._buffer = torch.ones(max_bytes, dtype=torch.uint8)
        self._size = torch.zeros(1, dtype=torch.int64)
        self._process = multiprocessing.get_context("spawn").Process(
            target=_gloo_sink, args=(self._port, max_bytes, chunk_bytes, num_connections, in_flight), daemon=True)
        self._group: dist.ProcessGroupGloo | None = None  # until connected

    def launch(self) -> None:
        self._process.start()

    def connect(self) -> None:
        self._group = _gloo_pair(self._port, 0, self._num_connections)

    def send_s(self, num_bytes: int) -> float:
        started = time.perf_counter()
        self._size.fill_(num_bytes)
        self._group.send([self._size], 1, 0).wait()
        _move_chunks(self._group, self._buffer, num_bytes, self._chunk_bytes, self._in_flight, is_sender=True)
        self._group.recv([self._size], 1, 0).wait()
        return time.perf_counter() - started

    def close(self) -> None:
        if self._group is not None and self._process.is_alive():
            self._size.fill_(0)
            self._group.send([self._size], 1, 0).wait()
        elif self._process.is_alive():  # never connected
            self._process.kill()
        self._process.join(10)


def _grpc_sink(port: int, heap_keep_bytes: int) -> None:
    keep_freed_heap(heap_keep_bytes)
    async def count(messages, _context) -> bytes:
        num_bytes = 0
        async for message in messages:
            num_bytes += len(message)
        return struct.pack("!Q", num_bytes)

    async def serve() -> None:
        server = grpc.aio.server(options=[*MESSAGE_OPTIONS, *BULK_TRANSFER_OPTIONS])
        handler = grpc.method_handlers_generic_handler(
            "bench.Sink", {"Count": grpc.stream_unary_rpc_method_handler(count)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


class GrpcReference:
    """Bare grpc-python: a client stream of `piece_bytes` messages to a sink process."""

    def __init__(self, max_bytes: int, piece_bytes: int, heap_keep_bytes: int) -> None:
        self._port = free_port()
        self._piece = b"\1" * piece_bytes
        self._process = multiprocessing.get_context("spawn").Process(target=_grpc_sink,
                                                                     args=(self._port, heap_keep_bytes), daemon=True)
        self._channel: grpc.aio.Channel | None = None  # until connected

    def launch(self) -> None:
        self._process.start()

    async def connect(self) -> None:
        self._channel = insecure_channel(f"127.0.0.1:{self._port}", BULK_TRANSFER_OPTIONS)
        await asyncio.wait_for(self._channel.channel_ready(), 60)
        self._count = self._channel.stream_unary("/bench.Sink/Count")

    async def send_s(self, num_bytes: int) -> float:
        async def pieces():
            for start in range(0, num_bytes, len(self._piece)):
                yield self._piece[:min(len(self._piece), num_bytes - start)]
        started = time.perf_counter()
        await self._count(pieces(), timeout=120)
        return time.perf_counter() - started

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._process.kill()
        self._process.join(10)


class MemcpyReference:
    def __init__(self, max_bytes: int) -> None:
        self._src = torch.empty(max_bytes, dtype=torch.uint8).fill_(1)
        self._dst = torch.empty(max_bytes, dtype=torch.uint8).fill_(0)  # pages faulted in, like the KV caches

    def copy_s(self, num_bytes: int) -> float:
        started = time.perf_counter()
        self._dst[:num_bytes].copy_(self._src[:num_bytes])
        return time.perf_counter() - started



@dataclasses.dataclass(frozen=True)
class References:
    tcp: TcpReference
    gloo: GlooReference | None
    grpc: GrpcReference | None
    memcpy: MemcpyReference
