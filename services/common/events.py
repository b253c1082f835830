"""`wait_set`: wait for an `asyncio.Event`, at most so long.

`asyncio.wait_for` on Python 3.11 drops a cancellation that arrives as the awaited thing
completes (CPython gh-86296); `asyncio.timeout` does not, so every bounded wait goes
through it.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` has passed; True if it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
