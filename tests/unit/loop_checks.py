"""Checks shared by the tests of background loops (it keeps running until it did its job, and cancels) and a fake lease."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest


async def until(is_done: Callable[[], bool], loop: asyncio.Task, timeout_s: float = 8.0) -> None:
    """Poll `is_done()` while asserting that `loop` is still running. Past `timeout_s` it fails only once
    `is_done()` was asked after a wake-up: a callback that held the event loop past the deadline (the first
    rich traceback a log.exception renders takes seconds on a loaded machine) may have done the job meanwhile,
    where a cancelling timeout failed a loop that had done it. `timeout_s` stays within the 10 s these modules
    give a test; it was 3 s, where loops whose job takes 0.7-2.1 s at load 19 left little margin."""
    deadline = time.monotonic() + timeout_s
    while not is_done():
        assert not loop.done(), f"the loop ended: {loop.exception() if not loop.cancelled() else 'cancelled'}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not done within {timeout_s} s")
        await asyncio.sleep(0.005)
    assert not loop.done()


async def assert_cancels(loop: asyncio.Task, timeout_s: float = 1.0) -> None:
    """Cancelling `loop` ends it promptly, as cancelled."""
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, timeout_s)
    assert loop.cancelled()


class FakeLease:
    """An etcd lease that renews, or raises the scripted `errors` in turn, then `error` while it is set."""

    lease_id = 0xF1

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.error: BaseException | None = None
        self.num_renewals = 0

    async def keepalive(self) -> bool:
        if self.errors:
            raise self.errors.pop(0)
        if self.error is not None:
            raise self.error
        self.num_renewals += 1
        return True
