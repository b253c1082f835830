"""The membership view's sync loop outlives any error from one read, and keeps the view current."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from services.common.errors import Internal
from services.common.membership import MembershipView
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)

PREFIX = "/ferry/test/instances/"


class FakeEtcd:
    """Full reads answer the scripted members (or raise), in turn; watches see nothing."""

    def __init__(self, *answers: BaseException | dict) -> None:
        self.answers = list(answers)
        self.kv = SimpleNamespace(get=self._get)
        self.watch = SimpleNamespace(watch=self._watch)
        self.num_reads = 0

    async def _get(self, prefix, range_end=None, timeout=None):
        self.num_reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        kvs = [SimpleNamespace(key=(PREFIX + k).encode(), value=json.dumps(v).encode()) for k, v in answer.items()]
        return SimpleNamespace(kvs=kvs, header=SimpleNamespace(revision=self.num_reads))

    async def _watch(self, prefix, range_end=None, start_revision=None):
        await asyncio.Event().wait()
        yield  # an async generator, like etcd3aio's watch


async def test_unexpected_read_errors_do_not_end_the_sync_loop():
    one, two = {"i-1": {"address": "a"}}, {"i-1": {"address": "a"}, "i-2": {"address": "b"}}
    etcd = FakeEtcd(one, RuntimeError("not connected"), Internal("boom"), two)
    view = MembershipView(etcd, PREFIX, resync_interval_s=0.1)
    view.start()
    assert await view.wait_synced(1.0)
    assert set(view.members) == {"i-1"}
    await until(lambda: "i-2" in view.members, view._task)
    await assert_cancels(view._task)
