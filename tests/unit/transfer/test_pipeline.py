import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.transfer.chunk_plan import ChunkPlan
from services.transfer.pipeline import BufferRing, GatherAhead, ScatterBehind
from services.transfer.staging import StagingPool
from tests.unit.transfer.factories import tiny_geometry

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


async def test_gather_ahead_stages_the_next_chunk_while_the_current_one_is_used(executor):
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=5, staging_bytes=512)  # 5 chunks of one block
    pool = StagingPool(1, 512)
    gathered: list[int] = []
    next_started = threading.Event()

    def gather(chunk, buffer):
        gathered.append(chunk.index)
        buffer.fill_(chunk.index)
        if chunk.index == 1:
            next_started.set()
        return buffer

    async with pool.slot(1.0) as slot:
        chunks = GatherAhead(plan, slot, gather, executor)
        seen = []
        async for chunk, staged in chunks:
            if chunk.index == 0:  # chunk 1 is being gathered into the other buffer meanwhile
                await asyncio.to_thread(next_started.wait, 5)
            assert int(staged[0]) == chunk.index  # never overwritten while in use
            seen.append((chunk.index, staged.data_ptr()))
        await chunks.close()
    assert gathered == [0, 1, 2, 3, 4]
    assert [ptr for _, ptr in seen[:2]] == [ptr for _, ptr in seen[2:4]]  # ping-pong over two buffers
    assert seen[0][1] != seen[1][1]


async def test_no_gather_starts_once_close_is_called_though_another_task_still_iterates(executor):
    """grpc.aio reads a request stream from a task of its own, which notices a failed call only at its
    next write: it was woken by the same gather as close() and started the next one, so the slot went
    back to the pool with a gather still writing into its buffer."""
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=5, staging_bytes=512)
    pool = StagingPool(1, 512)
    gathered: list[int] = []

    def gather(chunk, buffer):
        gathered.append(chunk.index)
        threading.Event().wait(0.05)
        return buffer

    async with pool.slot(1.0) as slot:
        chunks = GatherAhead(plan, slot, gather, executor)
        first = asyncio.Event()

        async def poll() -> None:  # as grpc's request-iterator task does
            async for _chunk, _staged in chunks:
                first.set()
        poller = asyncio.create_task(poll())
        await first.wait()  # chunk 1's gather runs; the poller waits for it
        await chunks.close()
        num_started = len(gathered)
        await asyncio.sleep(0.2)
        await poller
    assert gathered == [0, 1] and num_started == 2


async def test_scatter_behind_runs_in_order_and_reports_errors(executor):
    plan = ChunkPlan.for_staging(tiny_geometry(), num_blocks=4, staging_bytes=512)
    pool = StagingPool(1, 512)
    scattered: list[int] = []

    def scatter(chunk, staged):
        if chunk.index == 2:
            raise ValueError("boom")
        scattered.append(chunk.index)

    async with pool.slot(1.0) as slot:
        scatterer = ScatterBehind(slot, scatter, executor)
        with pytest.raises(ValueError, match="boom"):
            for chunk in plan.chunks():
                buffer = await scatterer.buffer_for(chunk)
                scatterer.submit(chunk, buffer)
            await scatterer.finish()
        await scatterer.close()
    assert scattered == [0, 1]


async def test_staging_slots_are_bounded():
    from services.common.errors import ResourceExhausted
    pool = StagingPool(1, 64)
    async with pool.slot(1.0):
        with pytest.raises(ResourceExhausted, match="--num-staging-slots"):
            async with pool.slot(0.05):
                pass
    assert pool.num_free == 1
    assert all(isinstance(b, torch.Tensor) for b in (await pool._free.get()).buffers)


def test_pre_encoded_data_messages_parse_as_the_proto():
    from services.common.gen.ferry.v1 import transfer_pb2
    from services.transfer.convert import encode_data_message
    for size in (0, 1, 127, 128, 300, 1 << 20):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        message = transfer_pb2.ReceiveBlocksRequest.FromString(encode_data_message(memoryview(data)))
        assert message.WhichOneof("part") == "data" and message.data == data


def test_data_messages_decode_as_views_and_the_header_as_the_proto():
    from services.common.gen.ferry.v1 import transfer_pb2
    from services.transfer.convert import decode_receive_blocks_message, encode_data_message
    data = bytes(range(256)) * 1000
    decoded = decode_receive_blocks_message(encode_data_message(memoryview(data[:100]), data[100:]))
    assert isinstance(decoded, memoryview) and decoded == data
    header = transfer_pb2.ReceiveBlocksRequest(header=transfer_pb2.BlocksHeader(dst_instance_id="b", blocks_per_chunk=2))
    decoded = decode_receive_blocks_message(header.SerializeToString())
    assert decoded == header
    with_extra = transfer_pb2.ReceiveBlocksRequest(data=b"abc").SerializeToString() + bytes([1 << 3 | 0, 7])  # unknown
    assert decode_receive_blocks_message(with_extra).data == b"abc"  # parsed, not sliced: the length does not match


async def test_buffer_ring_hands_each_buffer_out_again_only_when_its_work_is_done():
    pool = StagingPool(1, 64, buffers_per_slot=3)
    loop = asyncio.get_running_loop()
    async with pool.slot(1.0) as slot:
        ring = BufferRing(slot)
        works = [loop.create_future() for _ in range(3)]
        for index, work in enumerate(works):
            assert (await ring.acquire(index)) is slot.buffers[index]
            ring.hold(index, work)
        reuse = asyncio.ensure_future(ring.acquire(3))  # buffer 0 again: waits for works[0]
        await asyncio.sleep(0.01)
        assert not reuse.done()
        works[0].set_result(None)
        assert (await reuse) is slot.buffers[0]
        works[1].set_exception(RuntimeError("send failed"))
        with pytest.raises(RuntimeError, match="send failed"):
            await ring.drain()
        works[2].set_result(None)
        await ring.close()


def test_a_staging_slot_needs_two_buffers():
    with pytest.raises(ValueError, match="at least two"):
        StagingPool(1, 64, buffers_per_slot=1)


async def test_a_buffer_ring_closed_by_a_cancelled_caller_still_waits_for_its_work_and_reads_its_errors(executor):
    """close() is what keeps the slot taken until no thread uses its buffers: a caller cancelled while it
    waited there (a receiver whose RPC was cancelled as its sender died) gave the slot back at once, and
    left the work's errors unread ('Future exception was never retrieved')."""
    unretrieved: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
    release = threading.Event()

    def fails_when_released():
        release.wait(5)
        raise RuntimeError("gloo receive failed: connection reset by peer")

    async with StagingPool(1, 512).slot(1.0) as slot:
        ring = BufferRing(slot)
        ring.hold(0, asyncio.get_running_loop().run_in_executor(executor, fails_when_released))
        closing = asyncio.ensure_future(ring.close())
        await asyncio.sleep(0.05)
        closing.cancel()
        await asyncio.sleep(0.1)
        assert not closing.done()  # the work still uses a buffer
        release.set()
        await asyncio.wait([closing], timeout=5)
        assert closing.cancelled()
        del closing
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.02)
    # Only this work's error counts: tasks an earlier test in this worker left on no loop of its own
    # (a grpc.aio object bound to whatever loop runs) can be collected here too.
    ours = [context["message"] for context in unretrieved if "gloo receive failed" in str(context.get("exception"))]
    assert ours == [], unretrieved
