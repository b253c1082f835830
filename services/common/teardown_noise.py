"""The asyncio loop's exception handler, quiet about one known-harmless teardown.

etcd3aio's watch feeds gRPC a request generator that waits forever after its one request;
when a watch ends (a resync, etcd restarting), gRPC's task that reads that generator is
left pending and garbage-collected, and the generator's finalizer then fails with
"aclose(): asynchronous generator is already running". Nothing is lost (the stream is
cancelled and a new watch runs), but asyncio logs both as ERROR, a screenful after every
etcd restart. Those two go to debug; everything else to asyncio's default handler.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_GRPC_REQUEST_READER = "_StreamRequestMixin._consume_request_iterator"
_WATCH_REQUESTS = "watch.<locals>.request_generator"  # etcd3aio's, which never ends
_GENERATOR_RUNNING = "aclose(): asynchronous generator is already running"


def install_exception_handler() -> None:
    asyncio.get_running_loop().set_exception_handler(handle_exception)


def handle_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if is_watch_teardown(context):
        log.debug("etcd_watch_reader_dropped", message=context.get("message"))
        return
    loop.default_exception_handler(context)


def is_watch_teardown(context: dict[str, Any]) -> bool:
    task = context.get("task") or context.get("future")
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    if getattr(coro, "__qualname__", "") == _GRPC_REQUEST_READER:  # "Task was destroyed but it is pending!"
        frame = getattr(coro, "cr_frame", None)
        if frame is None:
            return True  # its coroutine was closed first: nothing is left to tell whose stream it read
        requests = frame.f_locals.get("request_iterator")
        return getattr(requests, "__qualname__", "").endswith(_WATCH_REQUESTS)  # not a stream of ours
    exception = context.get("exception")
    return isinstance(exception, RuntimeError) and str(exception) == _GENERATOR_RUNNING
