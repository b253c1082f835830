"""The engine thread outlives a command that raises: later calls are still answered."""

from __future__ import annotations

import asyncio

import pytest

from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.engine.request import SamplingParams
from services.instance.runner import EngineRunner

pytestmark = pytest.mark.timeout(10)


class FakeEngine:
    """Admits requests; aborting raises (a race with the engine's own bookkeeping)."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    def load(self) -> tuple[int, ...]:
        return (len(self.request_ids),)

    def has_unfinished(self) -> bool:
        return False

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0)

    def add_request(self, request_id, prompt_token_ids, sampling, priority=0, resume_token_ids=(), resume_text=None,
                    guide=None) -> None:
        self.request_ids.append(request_id)

    def abort(self, request_id: str) -> bool:
        raise KeyError(request_id)


async def test_a_failing_abort_soon_leaves_the_engine_thread_running():
    engine = FakeEngine()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        stream = await runner.add("r-1", [1, 2, 3], sampling=SamplingParams())
        runner.abort_soon(stream)
        assert await asyncio.wait_for(runner.call(lambda: len(engine.request_ids)), 2.0) == 1
        await asyncio.wait_for(runner.add("r-2", [4], sampling=SamplingParams()), 2.0)
        assert engine.request_ids == ["r-1", "r-2"]
    finally:
        runner.stop()


class FlakyLoadEngine(FakeEngine):
    """Its load figure fails once (a race with its own bookkeeping)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_load_failures = 0

    def load(self) -> tuple[int, ...]:
        if self.request_ids and self.num_load_failures == 0:
            self.num_load_failures += 1
            raise RuntimeError("load raced")
        return super().load()


async def test_a_command_whose_load_snapshot_fails_leaves_the_engine_thread_running():
    engine = FlakyLoadEngine()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        runner.call_soon(lambda: engine.request_ids.append("r-1"))  # its load snapshot raises
        assert await asyncio.wait_for(runner.call(lambda: len(engine.request_ids)), 2.0) == 1
        assert engine.num_load_failures == 1
    finally:
        runner.stop()
