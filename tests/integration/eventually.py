"""Waiting for a condition that another task or process makes true."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)
