import asyncio
import time

import pytest

from services.common.events import wait_set


async def test_returns_true_as_soon_as_the_event_is_set():
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, event.set)
    started = time.monotonic()
    assert await wait_set(event, 5.0)
    assert time.monotonic() - started < 1.0


async def test_returns_false_after_the_timeout():
    started = time.monotonic()
    assert not await wait_set(asyncio.Event(), 0.05)
    assert time.monotonic() - started >= 0.05


async def test_a_cancel_that_lands_with_the_set_is_not_lost():
    # Python 3.11's wait_for returned normally here (gh-86296), so a loop waiting on it went on.
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_set(event, 5.0))
    await asyncio.sleep(0)
    event.set()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
