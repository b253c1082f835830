"""Work that would stall the event loop (tokenizing a large prompt, building a large JSON answer),
run in a worker thread instead, so every other stream of the frontend keeps flowing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from services.common.task_errors import read_error

_T = TypeVar("_T")
_R = TypeVar("_R")


async def in_thread(fn: Callable[[_T], _R], arg: _T) -> _R:
    """`fn(arg)` in a worker thread. A caller cancelled meanwhile (the client left: handler_cancellation)
    waits for the thread before it ends, so the --max-inflight slot it holds is not given back while the
    thread still works (a second cancel, at shutdown, ends the wait, not the thread)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, arg))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        read_error(work)  # nobody is left to hear of it
        raise
