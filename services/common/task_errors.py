"""`read_error`: the error of a done task or future, marked as read.

asyncio logs "Task exception was never retrieved" (or "Future ...") with a traceback for a task whose
error nobody read. A caller that gave up on one (it was cancelled, or raised another error first, or
`asyncio.shield` stopped reading the future when its waiter was cancelled) reads it here, or passes
`read_error` to `add_done_callback`, so a failure it no longer needs is not logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def read_error(future: asyncio.Future) -> BaseException | None:
    """The error of a done `future`, marked as read; None when it succeeded or was cancelled."""
    return None if future.cancelled() else future.exception()


async def shielded(work: Awaitable[T]) -> T:
    """`await asyncio.shield(work)` for work that must finish even if this caller is cancelled, with
    its error read should it fail after the caller left (`shield` stops reading it then)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(read_error)
    return await asyncio.shield(task)
