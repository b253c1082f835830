"""periodic_loop: a step that raises is logged and the next step runs; cancelling stops it."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Internal
from services.common.periodic import periodic_loop
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FlakyStep:
    """Raises the scripted errors in turn, then counts successful steps."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.num_done = 0

    async def __call__(self) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.num_done += 1


async def test_a_failed_step_is_logged_and_the_next_one_runs():
    step = FlakyStep(Internal("boom"), KeyError("gone"))
    loop = asyncio.create_task(periodic_loop("test_loop", 0.01, step))
    await until(lambda: step.num_done >= 2, loop)
    assert not step.errors
    await assert_cancels(loop)


async def test_cancelling_stops_it_mid_step():
    started = asyncio.Event()

    async def slow_step() -> None:
        started.set()
        await asyncio.sleep(60)

    loop = asyncio.create_task(periodic_loop("test_loop", 0.01, slow_step))
    await asyncio.wait_for(started.wait(), 1.0)
    await assert_cancels(loop)
