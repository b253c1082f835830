"""A resume (Generate with the tokens its client has) reaching an instance that still streams the request to
a client gone without this instance noticing: it was frozen (SIGSTOP, a hung host), the frontend's keepalive
dropped the connection and resumed the request here, the only instance, and the resume came in on thawing
before the old stream's end did. On real engine runners (no sockets)."""

from __future__ import annotations

import pytest

from services.common.errors import Aborted, Unavailable
from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from services.instance.convert import sampling_to_proto
from services.instance.engine.request import RequestOrigin
from tests.unit.instance import test_migration
from tests.unit.instance.test_instance_shutdown_and_role import servicer_for
from tests.unit.instance.test_migration import PROMPT, SAMPLING, assert_no_blocks_held, reference

pytestmark = pytest.mark.timeout(60)
pair, tiny = test_migration.pair, test_migration.tiny  # its fixtures: two engine runners on the tiny model


def generate(servicer, resume_token_ids: list[int] = ()):
    return servicer.Generate(instance_pb2.GenerateRequest(request_id="r", prompt_token_ids=PROMPT,
                                                          sampling=sampling_to_proto(SAMPLING),
                                                          resume_token_ids=list(resume_token_ids)), None)


async def read_tokens(chunks, tokens: list[int], until: int | None = None) -> instance_pb2.GenerateChunk:
    """Feed `chunks` into `tokens` as a frontend does (indexes it holds are dropped); the last chunk read."""
    async for chunk in chunks:
        if chunk.token_index + len(chunk.token_ids) > len(tokens):
            tokens += chunk.token_ids[len(tokens) - chunk.token_index:]
        if chunk.finish_reason or (until is not None and len(tokens) >= until):
            return chunk
    raise AssertionError("the stream ended without a finish")


async def test_a_resume_takes_over_the_stream_its_client_left_unnoticed(pair):
    """Before, the resume was refused as a duplicate id (INVALID_ARGUMENT) and the client's request failed."""
    a, _ = pair
    expected = await reference(a)
    servicer = servicer_for(a)
    old, tokens = generate(servicer), []
    await read_tokens(old, tokens, until=10)  # then the instance froze, and the client's connection dropped
    resumed = generate(servicer, tokens)
    last = await read_tokens(resumed, tokens)
    assert tokens == expected and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    with pytest.raises(Unavailable, match="resumed"):  # its end, after whatever it still held
        async for chunk in old:
            assert chunk.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    await assert_no_blocks_held(a)


async def test_an_older_attempt_arriving_after_a_newer_one_is_refused_and_leaves_it_alone(pair):
    """Two attempts queued on a frozen instance, taken up in the wrong order: the one from fewer tokens is the
    older one (a frontend's tokens only grow), its client long gone."""
    a, _ = pair
    expected = await reference(a)
    servicer = servicer_for(a)
    tokens: list[int] = []
    await read_tokens(generate(servicer), tokens, until=10)
    newer = generate(servicer, tokens)
    await read_tokens(newer, tokens, until=20)
    with pytest.raises(Aborted, match="older attempt"):
        await anext(generate(servicer, tokens[:5]))
    last = await read_tokens(newer, tokens)
    assert tokens == expected and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await assert_no_blocks_held(a)


async def test_a_resume_in_place_of_a_migrated_in_copy_keeps_that_migrations_id(pair):
    """The source froze between the commit and the hand-off reaching the client; the frontend resumed the request
    on the destination, which dropped the unattached copy for it. The manager, asking the destination about that
    unanswered migration, found a resume and recorded `failed`, though the migration had committed: the
    destination now names the migration whose copy the resume replaced (RequestInfo.migration_id)."""
    a, b = pair
    expected = await reference(a)
    stream, tokens = await test_migration.moved_a_to_b(a, b)
    assert isinstance(await test_migration.read(stream, tokens), test_migration.Handoff)  # never reaches the client
    (copy,) = b.engine.list_requests()
    assert copy.migration_id.startswith("a-")
    chunks = generate(servicer_for(b), resume_token_ids=tokens)
    await read_tokens(chunks, tokens, until=len(tokens) + 1)
    (resumed,) = b.engine.list_requests()
    assert (resumed.origin, resumed.migration_id) == (RequestOrigin.RESUMED, copy.migration_id)
    await read_tokens(chunks, tokens)
    assert tokens == expected
    await assert_no_blocks_held(a, b)
