"""A client that goes away cancels the task reading its instance stream; the cancellation must
hold even when it lands just as a chunk arrives (asyncio.wait_for on Python 3.11 dropped it, so
the request ran to its end on the instance: CPython gh-86296)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.gen.ferry.v1 import instance_pb2
from services.frontend.instance_client import InstanceClients

pytestmark = pytest.mark.timeout(10)


class QueuedCall:
    """A Generate call whose messages the test puts in a queue."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[instance_pb2.GenerateChunk] = asyncio.Queue()
        self.is_cancelled = False

    async def read(self) -> instance_pb2.GenerateChunk:
        return await self.messages.get()

    def cancel(self) -> None:
        self.is_cancelled = True


async def test_a_cancel_that_lands_as_a_chunk_arrives_ends_the_reader():
    clients = InstanceClients(generate_timeout_s=30, abort_timeout_s=1)
    call, received = QueuedCall(), []

    async def read() -> None:
        async for chunk in clients._chunks("127.0.0.1:1", lambda stub: call):
            received.append(chunk)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.01)
    call.messages.put_nowait(instance_pb2.GenerateChunk(token_index=0))  # a chunk arrives ...
    reader.cancel()  # ... as the client goes away
    await asyncio.wait([reader], timeout=1)
    assert reader.cancelled() and call.is_cancelled
