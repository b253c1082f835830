"""What the cluster token costs a token stream: messages/s through ferry's channels with and without it.

A server process (ferry's own, `bind_grpc_server`: the same interceptors as every service) streams
--messages GenerateChunk-sized messages on each of --streams concurrent server streams; the client
reads them over `secure_or_insecure_channel`, once with no token (no interceptors either end) and once
with one (the client's call interceptors, the server's guard). Unary calls/s are measured the same
way (an Abort-sized call). Each figure is the median of --repeats runs, the two modes taking turns
(each first every other run). On a loaded machine compare the client's CPU time per message, which
other processes disturb less than the wall-clock rates, and best its event loop thread's alone: what
the token adds runs there, while gRPC's own polling threads spend more the busier the host is.

    python benchmarks/cluster_token_cost.py
    python benchmarks/cluster_token_cost.py --messages 5000 --streams 8 --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flags import HelpFormatter, at_least  # noqa: E402
from services.common.gen.ferry.v1 import instance_pb2  # noqa: E402
from services.common.grpc_server import bind_grpc_server, secure_or_insecure_channel  # noqa: E402
from services.common.tls import TlsConfig  # noqa: E402

SERVICE = "ferry.bench.Bench"
STREAM = f"/{SERVICE}/Stream"
CALL = f"/{SERVICE}/Call"
TOKEN = "b" * 64  # as `openssl rand -hex 32` makes
CHUNK = instance_pb2.GenerateChunk(request_id="cmpl-0123456789abcdef", token_index=17, token_ids=[4242],
                                   text=" word", epoch=1).SerializeToString()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=at_least(1), default=4000, help="messages per stream")
    parser.add_argument("--streams", type=at_least(1), default=4, help="concurrent server streams per run")
    parser.add_argument("--calls", type=at_least(1), default=2000, help="unary calls per run (4 at a time)")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="runs of each mode (median reported)")
    return parser.parse_args()


def _handlers() -> grpc.GenericRpcHandler:
    async def stream(request: bytes, context):
        for _ in range(int(request)):
            yield CHUNK

    async def call(request: bytes, context):
        return b""
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Call": grpc.unary_unary_rpc_method_handler(call)})


async def _serve(token: str, ports: multiprocessing.Queue) -> None:
    server = bind_grpc_server("127.0.0.1", 0, [SERVICE], tls=TlsConfig(cluster_token=token))
    await server.start([(lambda _servicer, grpc_server: grpc_server.add_generic_rpc_handlers((_handlers(),)), None)])
    ports.put(server.port)
    await asyncio.Event().wait()


def _server_main(token: str, ports: multiprocessing.Queue) -> None:
    asyncio.run(_serve(token, ports))


def start_server(token: str) -> tuple[multiprocessing.Process, int]:
    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=_server_main, args=(token, ports), daemon=True)
    process.start()
    return process, ports.get(timeout=60)


@dataclass(frozen=True, slots=True)
class Run:
    per_s: float  # messages (or calls) per second of wall time
    cpu_us: float  # the client process's CPU time per message (or call), all its threads, in microseconds
    loop_cpu_us: float  # the same, its event loop's thread alone


async def timed(work: Awaitable[int]) -> Run:
    wall, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    count = await work
    wall, cpu, loop_cpu = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - loop_cpu
    return Run(count / wall, cpu / count * 1e6, loop_cpu / count * 1e6)


async def stream_run(channel: grpc.aio.Channel, num_messages: int, num_streams: int) -> Run:
    """`num_streams` concurrent streams of `num_messages` each, read to their end."""
    method = channel.unary_stream(STREAM, response_deserializer=instance_pb2.GenerateChunk.FromString)

    async def read_one() -> int:
        return sum([1 async for _ in method(str(num_messages).encode(), timeout=600)])

    async def read_all() -> int:
        return sum(await asyncio.gather(*(read_one() for _ in range(num_streams))))
    return await timed(read_all())


async def call_run(channel: grpc.aio.Channel, num_calls: int, concurrency: int = 4) -> Run:
    """`num_calls` unary calls, `concurrency` at a time."""
    method = channel.unary_unary(CALL)

    async def caller(n: int) -> int:
        for _ in range(n):
            await method(b"r", timeout=60)
        return n

    async def call_all() -> int:
        return sum(await asyncio.gather(*(caller(num_calls // concurrency) for _ in range(concurrency))))
    return await timed(call_all())


async def measure(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, dict[str, list[Run]]]:
    channels = {mode: secure_or_insecure_channel(f"127.0.0.1:{port}", TlsConfig(cluster_token=_token(mode)))
                for mode, port in ports.items()}
    rates: dict[str, dict[str, list[Run]]] = {mode: {"stream": [], "unary": []} for mode in ports}
    try:
        for channel in channels.values():  # warm up: connect, first-call costs
            await stream_run(channel, 200, 1)
            await call_run(channel, 40)
        for repeat in range(args.repeats):
            for mode, channel in list(channels.items())[::1 if repeat % 2 else -1]:  # each goes first in turn
                rates[mode]["stream"].append(await stream_run(channel, args.messages, args.streams))
                rates[mode]["unary"].append(await call_run(channel, args.calls))
    finally:
        for channel in channels.values():
            await channel.close()
    return rates


def _token(mode: str) -> str:
    return TOKEN if mode == "token" else ""


def report(args: argparse.Namespace, rates: dict[str, dict[str, list[Run]]]) -> None:
    print(f"{args.streams} streams x {args.messages} messages, {args.calls} unary calls; "
          f"medians of {args.repeats} runs")
    print(f"{'':26} {'no token':>10} {'token':>10} {'token/none':>11}")
    for kind, unit in (("stream", "messages"), ("unary", "calls")):
        for label, read in ((f"{unit}/s", lambda run: run.per_s), (f"client CPU us/{unit[:-1]}", lambda run: run.cpu_us),
                            (f"loop CPU us/{unit[:-1]}", lambda run: run.loop_cpu_us)):
            off, on = (statistics.median(read(run) for run in rates[mode][kind]) for mode in ("off", "token"))
            print(f"{kind + ' ' + label:26} {off:>10,.1f} {on:>10,.1f} {on / off:>10.3f}x")


def main() -> None:
    args = parse_args()
    servers = {mode: start_server(_token(mode)) for mode in ("off", "token")}
    try:
        rates = asyncio.run(measure(args, {mode: port for mode, (_, port) in servers.items()}))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.join(10)
    report(args, rates)


if __name__ == "__main__":
    main()
