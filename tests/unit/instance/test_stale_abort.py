"""An Abort the frontend sent for an earlier copy of a request, taken up after a newer copy of it came to this
instance (a resume here, or a hand-off back here): the instance was slow or frozen, the Abort was queued in its
socket or retried past its deadline. It names the copy it ends (the frontend's attempt, the owner epoch), and a
newer copy is left alone. On real engine runners (no sockets)."""

from __future__ import annotations

import pytest

from services.common.errors import Aborted, NotFound
from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from services.instance.convert import sampling_to_proto
from tests.unit.instance import test_migration
from tests.unit.instance.test_generate_resume import read_tokens
from tests.unit.instance.test_instance_shutdown_and_role import servicer_for
from tests.unit.instance.test_migration import (PROMPT, SAMPLING, FaultyPeer, TensorCopier, assert_no_blocks_held,
                                                driver, plan, read, reference, servicer_moving_to)

pytestmark = pytest.mark.timeout(60)
pair, tiny = test_migration.pair, test_migration.tiny  # its fixtures: two engine runners on the tiny model


def generate(servicer, attempt: int, resume_token_ids: list[int] = ()):
    return servicer.Generate(instance_pb2.GenerateRequest(request_id="r", prompt_token_ids=PROMPT,
                                                          sampling=sampling_to_proto(SAMPLING), attempt=attempt,
                                                          resume_token_ids=list(resume_token_ids)), None)


def abort(attempt: int = 0, epoch: int = 0) -> instance_pb2.AbortRequest:
    return instance_pb2.AbortRequest(request_id="r", attempt=attempt, epoch=epoch)


async def test_an_abort_of_the_attempt_a_resume_replaced_leaves_the_resumed_copy_alone(pair):
    """Before, the late Abort ended the resumed copy: its client got an abort, or the frontend resumed again."""
    a, _ = pair
    expected = await reference(a)
    servicer = servicer_for(a)
    tokens: list[int] = []
    await read_tokens(generate(servicer, attempt=1), tokens, until=10)  # then the instance froze
    resumed = generate(servicer, attempt=2, resume_token_ids=tokens)
    await read_tokens(resumed, tokens, until=15)
    with pytest.raises(NotFound):  # attempt 1's Abort, taken up late: that copy is gone already
        await servicer.Abort(abort(attempt=1), None)
    last = await read_tokens(resumed, tokens)
    assert tokens == expected and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await assert_no_blocks_held(a)


@pytest.mark.parametrize("request_", [abort(attempt=2), abort()], ids=["its_attempt", "no_attempt"])
async def test_an_abort_of_the_copy_that_runs_or_of_no_attempt_ends_it(pair, request_):
    a, _ = pair
    servicer = servicer_for(a)
    tokens: list[int] = []
    await read_tokens(generate(servicer, attempt=1), tokens, until=5)
    resumed = generate(servicer, attempt=2, resume_token_ids=tokens)
    await read_tokens(resumed, tokens, until=8)
    assert (await servicer.Abort(request_, None)).was_running
    assert a.runner.stream("r") is None
    await assert_no_blocks_held(a)


async def test_a_migrated_in_copy_keeps_its_attempt_and_an_older_ones_abort_leaves_it_alone(pair):
    """Attempt 1 ran on b at epoch 1 and its Abort is late; attempt 2 (a resume on a) was handed to b again at
    epoch 1. Epochs alone cannot tell the two apart: the commit carries the attempt."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING, attempt=2)
    await read(stream, tokens, until=20)
    await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())
    handoff = await read(stream, tokens)
    assert b.runner.stream("r").attempt == 2 and handoff.epoch == 1
    servicer = servicer_for(b)
    for late in (abort(attempt=1, epoch=1), abort(attempt=2, epoch=0)):
        with pytest.raises(NotFound):
            await servicer.Abort(late, None)
    last = await read(b.inbox.attach("r", handoff.epoch, len(tokens)), tokens)
    assert tokens == expected and last.finish_reason is not None
    await assert_no_blocks_held(a, b)


async def test_an_older_attempts_abort_on_the_source_leaves_the_copy_its_unread_hand_off_left(pair):
    """The source forwards an Abort of a request that left moments ago to its copy, which nobody attached to yet
    (the client never read the hand-off). Not a late Abort of an older attempt: the frontend is about to attach."""
    a, b = pair
    servicer = servicer_moving_to(a, FaultyPeer(b))
    stream = await a.runner.add("r", PROMPT, SAMPLING, attempt=2)
    chunks = servicer._chunks(stream, from_token_index=0)
    await servicer.migrations.migrate_out(plan())
    assert [chunk async for chunk in chunks][-1].HasField("handoff")  # sent; the frontend attaches next
    with pytest.raises(NotFound):
        await servicer.Abort(abort(attempt=1, epoch=0), None)
    assert b.runner.stream("r") is not None and b.inbox.num_incoming == 1
    assert (await servicer.Abort(abort(attempt=2, epoch=0), None)).was_running  # its own: the copy is dropped
    assert b.runner.stream("r") is None and b.inbox.num_incoming == 0
    await assert_no_blocks_held(a, b)


async def test_an_older_attempt_from_as_many_tokens_is_refused_and_leaves_the_newer_alone(pair):
    """Two resumes from the same tokens (no token came between them) taken up in the wrong order: the token count
    cannot tell them apart, the attempt can. Before, the older took the newer's place, and its client was gone."""
    a, _ = pair
    expected = await reference(a)
    servicer = servicer_for(a)
    tokens: list[int] = []
    await read_tokens(generate(servicer, attempt=1), tokens, until=10)
    newer, held = generate(servicer, attempt=3, resume_token_ids=tokens), list(tokens)
    await read_tokens(newer, tokens, until=15)
    with pytest.raises(Aborted, match="older attempt"):
        await anext(generate(servicer, attempt=2, resume_token_ids=held))
    last = await read_tokens(newer, tokens)
    assert tokens == expected and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await assert_no_blocks_held(a)
