"""read_error: a done future's error, read so asyncio never logs it as "never retrieved"."""

from __future__ import annotations

import asyncio
import gc

import pytest

from services.common.task_errors import read_error

pytestmark = pytest.mark.timeout(10)


async def _fails() -> None:
    raise OSError("peer gone")


async def test_returns_the_error_and_none_for_a_success_or_a_cancel():
    failed = asyncio.ensure_future(_fails())
    succeeded = asyncio.ensure_future(asyncio.sleep(0))
    cancelled = asyncio.ensure_future(asyncio.sleep(10))
    cancelled.cancel()
    await asyncio.wait([failed, succeeded, cancelled])
    assert isinstance(read_error(failed), OSError)
    assert read_error(succeeded) is None and read_error(cancelled) is None


@pytest.mark.parametrize("is_read", [True, False])
async def test_a_read_error_is_never_logged_as_unretrieved(is_read):
    """As a done callback, it reads the error of a task nobody awaits; unread, asyncio reports it (the check
    that this test can fail)."""
    loop = asyncio.get_running_loop()
    unread: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    task = asyncio.ensure_future(_fails())
    if is_read:
        task.add_done_callback(read_error)
    await asyncio.wait([task])
    await asyncio.sleep(0)  # the done callbacks run
    del task
    gc.collect()
    assert [context["message"] for context in unread] == ([] if is_read else ["Task exception was never retrieved"])
