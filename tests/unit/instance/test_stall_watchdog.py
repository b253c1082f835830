"""The stall watchdog: a step that runs too long takes the instance out of service until it returns;
an engine whose step raised is out of service for good."""

from __future__ import annotations

import pytest

from services.instance.stall_watchdog import StallWatchdog

pytestmark = pytest.mark.timeout(10)


class FakeRunner:
    def __init__(self) -> None:
        self.is_broken = False
        self.step_running_for_s = 0.0
        self.abandoned = 0

    def abandon_all(self, error) -> int:
        self.abandoned += 1
        return 1


class Health:
    def __init__(self) -> None:
        self.states: list[bool] = []

    async def __call__(self, is_serving: bool) -> None:
        self.states.append(is_serving)


@pytest.mark.parametrize("timeout_s", [0.0, 120.0])
async def test_a_broken_engine_is_out_of_service_for_good_whatever_the_timeout(timeout_s):
    """Before, a broken engine still said SERVING and took migrations in whose commits then failed."""
    runner, health, exits = FakeRunner(), Health(), []
    watchdog = StallWatchdog(runner, timeout_s, health, lambda: False, on_broken=lambda: exits.append(1))
    await watchdog.check()
    assert health.states == [] and not watchdog.is_stalled
    runner.is_broken = True
    for _ in range(3):
        await watchdog.check()
    assert health.states == [False] and watchdog.is_stalled and exits == [1]  # the app then exits 1


async def test_a_long_step_stalls_and_its_return_recovers():
    runner, health = FakeRunner(), Health()
    watchdog = StallWatchdog(runner, 10.0, health, lambda: False)
    runner.step_running_for_s = 11.0
    await watchdog.check()
    assert health.states == [False] and watchdog.is_stalled and runner.abandoned == 1
    runner.step_running_for_s = 0.0
    await watchdog.check()
    assert health.states == [False, True] and not watchdog.is_stalled
