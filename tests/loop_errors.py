"""Catch what asyncio would log as "Task exception was never retrieved" during a test."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def unretrieved_errors() -> Iterator[list[dict[str, Any]]]:
    """The running loop's exception-handler contexts while the block runs (the handler is put back after)."""
    loop = asyncio.get_running_loop()
    caught: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))
    try:
        yield caught
    finally:
        loop.set_exception_handler(previous)


async def collect_dropped_tasks(turns: int = 3) -> None:
    """Let finished tasks settle, then collect them: an unread exception is reported as they go."""
    for _ in range(turns):
        await asyncio.sleep(0)
    gc.collect()
