"""The engine thread outlives a command that raises: later calls are still answered."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from services.common.errors import NotFound
from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.engine.step_output import StepOutput
from services.instance.engine.request import FinishReason, SamplingParams
from services.instance.handoff import Handoff
from services.instance.runner import EngineRunner

pytestmark = pytest.mark.timeout(10)


class FakeEngine:
    """Admits requests; aborting raises (a race with the engine's own bookkeeping)."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.scheduler = SimpleNamespace(suspended=[])  # none out of the batch

    def load(self) -> tuple[int, ...]:
        return (len(self.request_ids),)

    def has_unfinished(self) -> bool:
        return False

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0)

    def add_request(self, request_id, prompt_token_ids, sampling, priority=0, resume_token_ids=(), resume_text=None,
                    guide=None, first_start=None, replaced_migration_id="") -> None:
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


class SlowAbortEngine(FakeEngine):
    """Its abort waits until `release` is set (the engine in a long step), then finishes the request."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def abort_with_output(self, request_id: str) -> StepOutput:
        assert self.release.wait(5.0)
        self.request_ids.remove(request_id)
        return StepOutput(request_id, 0, (), "", FinishReason.ABORT, None, num_prompt_tokens=3)


async def test_an_abort_waiting_for_the_engine_frees_the_id_at_once_and_still_ends_its_stream():
    """A resume of the same request on this instance (the frontend falls back to a failed instance when
    no other serves) must not be refused as "already running" while the abort waits for a long step."""
    engine = SlowAbortEngine()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        old = await runner.add("r-1", [1, 2, 3], sampling=SamplingParams())
        aborting = asyncio.create_task(runner.abort("r-1"))
        await asyncio.sleep(0.05)  # the engine thread is in the abort now
        adding = asyncio.create_task(runner.add("r-1", [1, 2, 3], sampling=SamplingParams()))
        await asyncio.sleep(0.05)
        assert runner.stream("r-1") not in (None, old)  # the new request's stream took the id
        engine.release.set()
        assert await asyncio.wait_for(aborting, 2.0)
        new = await asyncio.wait_for(adding, 2.0)
        assert [o.finish_reason async for o in old] == [FinishReason.ABORT]
        assert runner.stream("r-1") is new and engine.request_ids == ["r-1"]
    finally:
        engine.release.set()
        runner.stop()


async def test_a_command_whose_load_snapshot_fails_still_returns_its_result():
    """The command succeeded; only the load figure taken after it failed: its caller gets its result."""
    engine = FlakyLoadEngine()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        def add() -> int:
            engine.request_ids.append("r-1")  # its load snapshot raises
            return len(engine.request_ids)
        assert await asyncio.wait_for(runner.call(add), 2.0) == 1
        assert engine.num_load_failures == 1
    finally:
        runner.stop()


class LongStepEngine(FakeEngine):
    """One long step (until `release`) that gives r-1 its output token 5; idle after it."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step, self.release = threading.Event(), threading.Event()
        self.last_step_was_idle = False
        self.has_stepped = False

    def has_unfinished(self) -> bool:
        return bool(self.request_ids) and not self.has_stepped

    def step(self) -> list[StepOutput]:
        self.has_stepped = True
        self.in_step.set()
        assert self.release.wait(5.0)
        return [StepOutput("r-1", 5, (42,), "x", None, None, num_prompt_tokens=3)]

    def abort(self, request_id: str) -> bool:
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str) -> StepOutput:
        self.request_ids.remove(request_id)
        return StepOutput(request_id, 6, (), "", FinishReason.ABORT, None, num_prompt_tokens=3)


@pytest.mark.parametrize("waits", [True, False], ids=["abort", "abort_soon"])
async def test_what_a_step_gave_an_aborted_request_never_reaches_a_new_one_under_its_id(waits):
    """A resume of the same request on this instance while the abort of its old copy waits for a long step:
    the step's output is the old copy's (to its own stream, if it still has a reader), never the new one's
    (before, the new stream got the old copy's token 5 first: a token of another request, or its finish)."""
    engine = LongStepEngine()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        old = await runner.add("r-1", [1, 2, 3], sampling=SamplingParams())
        assert await asyncio.to_thread(engine.in_step.wait, 2.0)
        if waits:
            aborting = asyncio.create_task(runner.abort("r-1"))
        else:
            runner.abort_soon(old)
        await asyncio.sleep(0.05)
        adding = asyncio.create_task(runner.add("r-1", [1, 2, 3], sampling=SamplingParams(),
                                                resume_token_ids=(7, 7, 7, 7, 7)))
        await asyncio.sleep(0.05)
        engine.release.set()
        if waits:
            assert await asyncio.wait_for(aborting, 2.0)
            assert [(o.token_index, o.finish_reason) async for o in old] == [(5, None), (6, FinishReason.ABORT)]
        new = await asyncio.wait_for(adding, 2.0)
        await runner.call(lambda: None)  # whatever the step published has been delivered
        assert new.outputs.empty() and runner.stream("r-1") is new
    finally:
        engine.release.set()
        runner.stop()


class ReleaseRacingEngine(FakeEngine):
    """A hand-off's release finds the request gone (NotFound): it finished or was aborted meanwhile."""

    def release(self, request_id: str) -> None:
        raise NotFound(f"request {request_id} is not on this instance")

    def abort(self, request_id: str) -> bool:
        if request_id not in self.request_ids:
            return False
        self.request_ids.remove(request_id)
        return True


async def test_a_failed_hand_off_aborts_only_the_copy_it_handed_off():
    """The hand-off's release fails, and a resume of the same request is admitted here before the hand-off's
    fallback abort could run: that abort is the handed-off copy's, never the resume's (before, an abort by id
    after the failed release ended the resume that had come in meanwhile)."""
    engine, busy = ReleaseRacingEngine(), threading.Event()
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        old = await runner.add("r-1", [1, 2, 3], sampling=SamplingParams())
        engine.request_ids.remove("r-1")  # finished or aborted in the engine: the release will find nothing
        runner.call_soon(lambda: busy.wait(5.0))  # the engine thread in a long step: commands queue up
        handing = asyncio.create_task(runner.hand_off("r-1", Handoff("b", "b:1", 1, 0), old))
        await asyncio.sleep(0.05)  # the release is queued; the id is free here
        adding = asyncio.create_task(runner.add("r-1", [1, 2, 3], sampling=SamplingParams(), resume_token_ids=(7,)))
        await asyncio.sleep(0.05)  # the resume's admission is queued after the release
        busy.set()
        with pytest.raises(NotFound):
            await asyncio.wait_for(handing, 2.0)
        new = await asyncio.wait_for(adding, 2.0)
        await runner.call(lambda: None)  # any abort the hand-off queued has run
        assert engine.request_ids == ["r-1"] and runner.stream("r-1") is new
    finally:
        busy.set()
        runner.stop()
