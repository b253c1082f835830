"""Instance shutdown stops the engine thread before it frees the KV cache: a step still running when
the wait ends (a long prefill on a slow CPU) keeps the cache mapped, and the process exit frees it."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from services.instance import app
from services.instance.engine.factory import LoadedEngine
from services.instance.engine.kv_cache import SHM_DIR, KvCache, KvGeometry
from services.instance.engine.prefix_cache import PrefixCacheStats
from services.instance.runner import EngineRunner

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
