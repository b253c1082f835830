"""ReqState: token indexes accepted once, no gaps, deltas for the handler (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Unavailable
from services.frontend.generation import FinishReason, TokenChunk
from services.frontend.req_state import StreamGap

from tests.unit.frontend.factories import chunk, make_state

pytestmark = pytest.mark.timeout(10)


def test_chunks_in_order_build_the_output():
    state = make_state()
    state.accept(chunk(0, 7, 8))
    delta = state.accept(chunk(2, 9, finish=FinishReason.STOP))
    assert state.token_ids == [7, 8, 9] and state.text == "hij"
    assert delta.token_index == 2 and delta.token_ids == (9,) and delta.finish_reason is FinishReason.STOP
    assert state.is_done and state.finish_reason is FinishReason.STOP


def test_a_repeated_chunk_is_dropped():
    state = make_state()
    state.accept(chunk(0, 7, 8))
    assert state.accept(chunk(0, 7, 8)) is None
    assert state.accept(chunk(1, 8)) is None
    assert state.token_ids == [7, 8]


def test_an_overlapping_chunk_keeps_only_new_tokens_and_their_text():
    state = make_state()
    state.accept(chunk(0, 7, 8))
    delta = state.accept(TokenChunk(token_index=1, token_ids=(8, 9, 10), text="ijk", finish_reason=None))
    assert delta.token_ids == (9, 10) and delta.text == "jk" and delta.token_index == 2
    assert state.token_ids == [7, 8, 9, 10] and state.text == "hijk"


def test_a_gap_breaks_the_stream():
    state = make_state()
    state.accept(chunk(0, 7))
    with pytest.raises(StreamGap, match="starts at token 3, but only 1 tokens arrived"):
        state.accept(chunk(3, 9))
    assert isinstance(StreamGap("x"), Unavailable)  # so the runner resumes


def test_nothing_is_accepted_after_the_end():
    state = make_state()
    state.accept(chunk(0, 7, finish=FinishReason.LENGTH))
    assert state.accept(chunk(1, 8)) is None
    state.fail(Unavailable("late"))
    assert state.error is None and state.token_ids == [7]


async def test_deltas_arrive_in_order_and_end_with_the_finish():
    state = make_state()

    async def feed():
        for i in range(3):
            await asyncio.sleep(0)
            state.accept(chunk(i, 10 + i))
        state.accept(chunk(3, finish=FinishReason.STOP))

    feeder = asyncio.create_task(feed())
    seen = [delta async for delta in state.deltas()]
    await feeder
    assert [d.token_ids for d in seen] == [(10,), (11,), (12,), ()]
    assert seen[-1].finish_reason is FinishReason.STOP


async def test_deltas_raise_the_error_after_what_arrived():
    state = make_state()
    state.accept(chunk(0, 5))
    state.fail(Unavailable("instance gone"))
    seen = []
    with pytest.raises(Unavailable, match="instance gone"):
        async for delta in state.deltas():
            seen.append(delta)
    assert [d.token_ids for d in seen] == [(5,)]


async def test_deltas_published_before_the_error_reach_the_client_before_it():
    state = make_state()
    state.accept(chunk(0, 4))
    seen = []

    async def consume():
        async for delta in state.deltas():
            seen.append(delta.token_ids)
            await asyncio.sleep(0.05)  # the client is slow to take a chunk (socket write)
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.01)  # consumer holds token 0, is writing it
    state.accept(chunk(1, 5))  # token 1 arrives ...
    state.fail(Unavailable("resumes exhausted"))  # ... then the request fails
    with pytest.raises(Unavailable):
        await consumer
    assert seen == [(4,), (5,)], f"token 1 was accepted (state.token_ids={state.token_ids}) but never yielded"



def test_texts_read_between_pieces_hold_everything_accepted():
    """The texts are kept in pieces, joined when read: reads in between see all of it, and later pieces add on."""
    state = make_state()
    expected = ""
    for index in range(300):
        piece = "" if index % 7 == 0 else f"<{index}>"  # empty texts too (a token that completes no character)
        state.accept(TokenChunk(token_index=index, token_ids=(7,), text=piece, finish_reason=None))
        expected += piece
        if index % 50 == 0:
            assert state.text == state.plain_text == expected
    assert state.text == state.plain_text == expected
