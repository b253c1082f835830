"""Following a live-migration hand-off through real sockets: the frontend's HTTP server and
gRPC clients in this process; a scripted source instance that ends its Generate stream with
a hand-off, and a scripted destination that serves Attach (both on free 127.0.0.1 ports).

Tokens follow `expected_token` (test_frontend_resume.py), so wherever a token is produced
(source, destination, or an instance a request was resumed on) it is the same token.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from tests.integration.eventually import eventually
from tests.integration.test_frontend_resume import (MODEL, PROMPT, PROMPT_IDS, CharTokenizer, ScriptedInstance,
                                                    cluster, expected_token, post)

__all__ = ["cluster"]  # the fixture, shared with the resume tests

pytestmark = pytest.mark.timeout(60)


def token_chunk(request, prompt, index, epoch, handoff=None):
    token = expected_token(prompt, index)
    last = index == request.sampling.max_tokens - 1
    return instance_pb2.GenerateChunk(
        request_id=request.request_id, token_index=index, token_ids=[token], text=CharTokenizer().decode([token]),
        epoch=epoch, finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
        handoff=handoff)


class Destination(ScriptedInstance):
    """Adopts requests from a source (as CommitMigrateIn would) and streams them on Attach."""

    def __init__(self, fail_attach: bool = False, resend_from: int | None = None, delay_s: float = 0.0) -> None:
        super().__init__(delay_s=delay_s)
        self.fail_attach = fail_attach  # Attach answers UNAVAILABLE (the destination died after commit)
        self.resend_from = resend_from  # stream from here even if asked for later tokens (a repeat)
        self.adopted: dict[str, tuple[instance_pb2.GenerateRequest, int]] = {}
        self.attaches: list[instance_pb2.AttachRequest] = []

    def adopt(self, request: instance_pb2.GenerateRequest, epoch: int) -> None:
        self.adopted[request.request_id] = (request, epoch)

    async def Attach(self, request, context):
        self.attaches.append(request)
        if self.fail_attach:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "destination is going away")
        generate, epoch = self.adopted[request.request_id]
        if request.epoch != epoch:
            await context.abort(grpc.StatusCode.ABORTED, f"epoch {request.epoch} is stale; the request is at {epoch}")
        prompt = list(generate.prompt_token_ids)
        self.running.add(request.request_id)
        try:
            start = request.from_token_index if self.resend_from is None else self.resend_from
            yield token_chunk(generate, prompt, start, epoch=epoch - 1)  # stale: sent by the old owner's epoch
            for index in range(start, generate.sampling.max_tokens):
                await asyncio.sleep(self.delay_s)
                yield token_chunk(generate, prompt, index, epoch)
        finally:
            self.running.discard(request.request_id)


class Source(ScriptedInstance):
    """Streams `handoff_after` tokens, then hands the request off to `dst` (as a committed migration does)."""

    def __init__(self, dst: Destination, handoff_after: int) -> None:
        super().__init__()
        self.dst = dst
        self.handoff_after = handoff_after

    async def Generate(self, request, context):
        self.requests.append(request)
        prompt = list(request.prompt_token_ids)
        for index in range(self.handoff_after):
            yield token_chunk(request, prompt, index, epoch=0)
        self.dst.adopt(request, epoch=1)
        yield instance_pb2.GenerateChunk(request_id=request.request_id, token_index=self.handoff_after, epoch=0,
                                         handoff=instance_pb2.Handoff(dst_instance_id=self.dst.instance_id,
                                                                      dst_address=self.dst.address, epoch=1,
                                                                      next_token_index=self.handoff_after))


def stream_events(raw: bytes) -> list[dict]:
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def stream_token_ids(base_url: str, max_tokens: int) -> tuple[list[int], str, list[dict]]:
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                                        "return_token_ids": True})
    assert status == 200, raw
    chunks = stream_events(raw)
    token_ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    text = "".join(c["choices"][0].get("text", "") for c in chunks)
    return token_ids, text, chunks


async def test_a_handed_off_stream_reaches_the_client_as_one_stream(cluster):
    dst = Destination(resend_from=2)  # also repeats tokens 2..4 the client already has
    src = Source(dst, handoff_after=5)
    base_url, metrics = await cluster(src, dst)
    token_ids, text, chunks = await stream_token_ids(base_url, 12)
    expected = [expected_token(PROMPT_IDS, i) for i in range(12)]
    assert token_ids == expected and text == CharTokenizer().decode(expected)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    (attach,) = dst.attaches
    assert (attach.request_id, attach.from_token_index, attach.epoch) == (chunks[0]["id"], 5, 1)
    assert metrics.handoffs._value.get() == 1 and metrics.resumes._value.get() == 0
    assert src.aborted == [] and dst.aborted == []


async def test_a_failed_attach_resumes_on_another_instance(cluster):
    dst = Destination(fail_attach=True)
    src = Source(dst, handoff_after=3)
    spare = ScriptedInstance()
    base_url, metrics = await cluster(src, dst, spare)
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == [expected_token(PROMPT_IDS, i) for i in range(8)]
    assert len(spare.requests) == 1 and len(spare.requests[0].resume_token_ids) == 3
    await eventually(lambda: dst.aborted == [spare.requests[0].request_id],
                     what="the owner after the hand-off told to free it")
    assert metrics.handoffs._value.get() == 1 and metrics.resumes._value.get() == 1


async def test_a_client_that_leaves_while_attached_aborts_on_the_destination(cluster):
    dst = Destination(delay_s=0.05)
    src = Source(dst, handoff_after=2)
    base_url, _ = await cluster(src, dst)
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{base_url}/v1/completions",
                                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True})
        for _ in range(100):
            if dst.running:
                break
            await response.content.readline()
        request_id = src.requests[0].request_id
        assert dst.running == {request_id}
        response.close()
    for _ in range(100):
        if not dst.running and dst.aborted:
            break
        await asyncio.sleep(0.05)
    assert dst.running == set() and dst.aborted == [request_id] and src.aborted == []
