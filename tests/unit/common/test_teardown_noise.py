"""The loop's exception handler: quiet about the etcd watch teardown, default for the rest."""

from __future__ import annotations

import asyncio

import pytest

from services.common.teardown_noise import handle_exception

pytestmark = pytest.mark.timeout(10)


class _StreamRequestMixin:  # named as gRPC's class, whose task reads a stream's request generator
    async def _consume_request_iterator(self, request_iterator) -> None:
        async for _ in request_iterator:
            pass


class WatchService:  # named as etcd3aio's, whose request generator never ends
    def watch(self):
        async def request_generator():
            yield "create"
            await asyncio.Event().wait()
        return request_generator()


async def our_requests():
    yield "request"
    await asyncio.Event().wait()


async def test_the_watch_teardown_is_quiet_and_anything_else_goes_to_asyncio(monkeypatch):
    loop = asyncio.get_running_loop()
    passed_on = []
    monkeypatch.setattr(loop, "default_exception_handler", passed_on.append)
    watch_reader = asyncio.create_task(_StreamRequestMixin()._consume_request_iterator(WatchService().watch()))
    our_reader = asyncio.create_task(_StreamRequestMixin()._consume_request_iterator(our_requests()))
    await asyncio.sleep(0)
    handle_exception(loop, {"message": "Task was destroyed but it is pending!", "task": watch_reader})
    handle_exception(loop, {"message": "Task exception was never retrieved",
                            "exception": RuntimeError("aclose(): asynchronous generator is already running")})
    assert passed_on == []
    ours = {"message": "Task was destroyed but it is pending!", "task": our_reader}
    bug = {"message": "Task exception was never retrieved", "exception": RuntimeError("a real bug")}
    handle_exception(loop, ours)
    handle_exception(loop, bug)
    assert passed_on == [ours, bug]
    watch_reader.cancel()
    our_reader.cancel()
