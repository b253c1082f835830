"""Instance shutdown stops the engine thread before it frees the KV cache: a step still running when
the wait ends (a long prefill on a slow CPU) keeps the cache mapped, and the process exit frees it."""

from __future__ import annotations

import asyncio
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from services.instance import app
from services.instance.engine.factory import LoadedEngine
from services.instance.engine.kv_cache import SHM_DIR, KvCache, KvGeometry
from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.runner import EngineRunner
from tests.torch_children import TORCH_CHILD_TIMEOUT_S

pytestmark = pytest.mark.timeout(20)

GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=4, dtype=torch.float32)
NUM_ELEMENTS = math.prod(GEOMETRY.shape)


class LongStepEngine:
    """One step that reads the KV cache until `release` is set."""

    def __init__(self, kv_cache: KvCache) -> None:
        self.kv_cache = kv_cache
        self.scheduler = SimpleNamespace(suspended=[])
        self.stepping, self.release = threading.Event(), threading.Event()
        self.last_step_was_idle = False
        self.num_cache_reads = 0

    def load(self) -> tuple[int, ...]:
        return (0,)

    def has_unfinished(self) -> bool:
        return not self.release.is_set()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0)

    def step(self) -> list:
        self.stepping.set()
        self.release.wait(10)
        self.num_cache_reads += self.kv_cache.tensor.numel() == NUM_ELEMENTS  # the engine's own read
        return []


@pytest.fixture
def loaded():
    name = f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = KvCache.create(name, GEOMETRY)
    yield LoadedEngine(LongStepEngine(cache), cache, 16)
    cache.unlink()
    assert not (SHM_DIR / name).exists()


async def test_a_step_past_the_wait_keeps_the_cache_and_the_next_stop_frees_it(loaded):
    engine = loaded.engine
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        assert await asyncio.to_thread(engine.stepping.wait, 5)
        app.stop_engine(runner, loaded, timeout_s=0.2)  # the step runs on
        assert loaded.kv_cache.tensor.numel() == NUM_ELEMENTS
        assert (SHM_DIR / loaded.kv_cache.name).exists()
    finally:
        engine.release.set()
    app.stop_engine(runner, loaded, timeout_s=5)
    assert engine.num_cache_reads == 1 and loaded.kv_cache.tensor.numel() == 0
    assert not (SHM_DIR / loaded.kv_cache.name).exists()


# An instance process whose engine step (torch work) outlasts the shutdown's wait for it.
STEP_PAST_SHUTDOWN = '''
import asyncio, sys, threading, time
from types import SimpleNamespace
import torch
from services.common.config import parse_config
from services.common.startup import run_service
from services.instance import app
from services.instance.config import InstanceConfig
from services.instance.engine.factory import LoadedEngine
from services.instance.engine.kv_cache import KvCache
from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.runner import EngineRunner
from tests.torch_children import TORCH_CHILD_TIMEOUT_S
from tests.unit.instance.test_engine_stop import GEOMETRY, STEP_S

class TorchStepEngine:
    scheduler, last_step_was_idle, stepping = SimpleNamespace(suspended=[]), False, threading.Event()
    load, has_unfinished = lambda self: (0,), lambda self: True
    prefix_cache_stats = lambda self: PrefixCacheStats(0, 0)
    def step(self):
        self.stepping.set()
        print("step started at", time.monotonic(), flush=True)  # the clock is the test's (CLOCK_MONOTONIC)
        a, until = torch.randn(256, 256), time.monotonic() + STEP_S
        while time.monotonic() < until:
            a = (a @ a).tanh()
        return []

class QuickStopRunner(EngineRunner):
    def stop(self, timeout_s=10.0):
        return super().stop(0.5)

engine = TorchStepEngine()
loaded = LoadedEngine(engine, KvCache.create(sys.argv[1], GEOMETRY), 16)

async def serve(config, loaded, runner):
    await asyncio.to_thread(engine.stepping.wait, 20)
    if sys.argv[2] == "failed":
        raise RuntimeError("serving failed")

app.build_engine, app.reclaim_stale_segments, app.serve = lambda spec: loaded, lambda: [], serve
app.EngineRunner = QuickStopRunner
run_service(app.main(parse_config(InstanceConfig, "instance", [])))
'''


STEP_S = 60  # how long the step runs on


@pytest.mark.timeout(TORCH_CHILD_TIMEOUT_S + STEP_S + 30)
@pytest.mark.parametrize(("ending", "status"), [("stopped", 0), ("failed", 1)])
def test_a_step_past_the_shutdown_wait_ends_the_process_without_its_teardown(ending, status):
    """Interpreter teardown under a step still running torch aborted the process (SIGABRT, "terminate called
    without an active exception"): the instance leaves at once instead, exiting 0 after a clean shutdown (1 if
    serving failed, logged), with its KV memory's name removed and its log flushed."""
    name = f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root = pathlib.Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run([sys.executable, "-c", STEP_PAST_SHUTDOWN, name, ending], cwd=root, capture_output=True,
                              text=True, timeout=TORCH_CHILD_TIMEOUT_S + STEP_S, env={**os.environ, "PYTHONPATH": str(root)})
        ended = time.monotonic()
        log = done.stdout + done.stderr
        assert done.returncode == status, log[-3000:]
        step_started = float(re.search(r"^step started at (\S+)$", done.stdout, re.MULTILINE).group(1))
        assert ended - step_started < STEP_S / 2  # not after the step (however long the child took to start)
        assert "engine_step_outlived_shutdown" in log and "terminate called" not in log
        assert ("serving failed" in log) == (ending == "failed")
        assert not (SHM_DIR / name).exists()
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)
