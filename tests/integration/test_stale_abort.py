"""An Abort queued in a frozen instance's socket, taken up on thawing after the resume of the same request there:
the frontend left the frozen copy (attempt 1), its Abort could not be called back, and it resumed the request on
the same instance (attempt 2). The Abort names attempt 1, so the instance leaves the resumed copy alone. A real
instance process, SIGSTOPped and SIGCONTed; the Abort is sent after the resume, on the same connection, so the
instance takes them up in that order (the order a reconnect, or a retry past its deadline, can give)."""

from __future__ import annotations

import asyncio
import signal
import uuid

import grpc
import pytest

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from tests.integration.test_instance_service import greedy, instance, metrics_port, reference_tokens

pytestmark = pytest.mark.timeout(120)
__all__ = ["instance", "metrics_port"]  # its fixtures: one real instance process on the tiny model

PROMPT = [5, 17, 42, 99, 7, 3]
NUM_TOKENS = 40


async def read_into(call, tokens: list[int], until: int | None = None) -> instance_pb2.GenerateChunk:
    """Feed the chunks of `call` into `tokens` as a frontend does; the last chunk read."""
    async for chunk in call:
        tokens += chunk.token_ids[len(tokens) - chunk.token_index:]
        if chunk.finish_reason or (until is not None and len(tokens) >= until):
            return chunk
    raise AssertionError("the stream ended without a finish")


async def test_an_abort_queued_in_a_frozen_instance_leaves_the_resumed_copy_alone(instance, tiny_model_dir):
    """Before, the late Abort ended the resumed copy: its stream finished with `abort` after a few tokens."""
    expected = reference_tokens(tiny_model_dir, PROMPT, NUM_TOKENS)
    request_id, tokens = f"stale-{uuid.uuid4().hex[:6]}", []
    async with grpc.aio.insecure_channel(instance.address) as channel:
        stub = instance_pb2_grpc.InstanceServiceStub(channel)
        first = stub.Generate(instance_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                                           sampling=greedy(NUM_TOKENS), attempt=1), timeout=60)
        await read_into(first, tokens, until=5)
        instance.signal(signal.SIGSTOP)
        try:
            first.cancel()  # the frontend gave up on the frozen copy ...
            resumed = stub.Generate(instance_pb2.GenerateRequest(
                request_id=request_id, prompt_token_ids=PROMPT, sampling=greedy(NUM_TOKENS),
                resume_token_ids=tokens, attempt=2), timeout=60)  # ... resumed it there ...
            await asyncio.sleep(0.3)
            late_abort = stub.Abort(instance_pb2.AbortRequest(request_id=request_id, attempt=1, epoch=0),
                                    timeout=30)  # ... and its Abort of the frozen copy comes after
            await asyncio.sleep(0.3)
        finally:
            instance.signal(signal.SIGCONT)
        last = await read_into(resumed, tokens)
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and tokens == expected
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await late_abort
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND
