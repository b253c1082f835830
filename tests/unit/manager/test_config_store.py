"""The config watch loop outlives any error from one read-and-apply, and applies the settings next time."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from services.manager.config_store import ClusterSettings, ConfigStore
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FakeEtcd:
    """config/ holds one policy; watches see nothing."""

    def __init__(self) -> None:
        self.kv = SimpleNamespace(get=self._get)
        self.watch = SimpleNamespace(watch=self._watch)

    async def _get(self, prefix, range_end=None, timeout=None):
        policy = SimpleNamespace(key=b"/ferry/test/config/policy", value=json.dumps({"dispatch": "load"}).encode())
        return SimpleNamespace(kvs=[policy], header=SimpleNamespace(revision=3))

    async def _watch(self, prefix, range_end=None, start_revision=None):
        await asyncio.Event().wait()
        yield  # an async generator, like etcd3aio's watch


class FlakyApply:
    """Raises the scripted errors in turn, then keeps what it is given."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.applied: list[ClusterSettings] = []

    def __call__(self, settings: ClusterSettings) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.applied.append(settings)


async def test_a_failed_apply_does_not_end_the_watch_and_the_settings_apply_next_time():
    apply = FlakyApply(ValueError("unknown pairing"))
    loop = asyncio.create_task(ConfigStore(FakeEtcd(), "test", "m-1").watch_loop(apply))
    await until(lambda: bool(apply.applied), loop)
    assert apply.applied[0].dispatch_policy == "load"
    await assert_cancels(loop)
