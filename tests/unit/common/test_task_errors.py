"""read_error: a done future's error, read so asyncio never logs it as "never retrieved"."""

from __future__ import annotations

import asyncio
import gc

import pytest

from services.common.task_errors import read_error, shielded

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


@pytest.mark.parametrize("shield", [shielded, asyncio.shield])
async def test_shielded_work_that_fails_after_its_caller_left_is_not_logged(shield):
    """A caller cancelled while shielded work runs (an RPC's deadline) must not stop it; the work's later
    error is read by `shielded`, while plain asyncio.shield leaves it unread (the check this test can fail)."""
    loop = asyncio.get_running_loop()
    unread: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    release = asyncio.Event()

    async def fails_later() -> None:
        await release.wait()
        raise OSError("engine gone")

    caller = asyncio.ensure_future(shield(fails_later()))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    await asyncio.sleep(0.01)
    del caller
    gc.collect()
    expected = [] if shield is shielded else ["Task exception was never retrieved"]
    assert [context["message"] for context in unread] == expected


async def test_shielded_passes_the_result_and_the_error_through():
    async def answer() -> int:
        return 42

    assert await shielded(answer()) == 42
    with pytest.raises(OSError, match="peer gone"):
        await shielded(_fails())
