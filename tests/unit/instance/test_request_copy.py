"""A migration and a PD hand-off act on the copy of the request they started with, never on a copy that took its
id meanwhile: the first was aborted (its client left) and the frontend resumed the request on this same instance,
where the new copy may be parked by its own PD hand-off. On real engine runners (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Aborted, Unavailable
from services.instance.config import InstanceRole, PdHandoff
from services.instance.engine.request import FinishReason
from services.instance.handoff import Handoff
from services.instance.pd_handoff import DecodeHandoff
from tests.unit.instance import test_migration
from tests.unit.instance.test_migration import (PROMPT, SAMPLING, DecodePlacer, FaultyPeer, SlowDecodePlacer,
                                                TensorCopier, assert_no_blocks_held, driver, plan, read, reference)

pytestmark = pytest.mark.timeout(60)
pair, tiny = test_migration.pair, test_migration.tiny  # its fixtures: two engine runners on the tiny model


async def status(side, request_id: str = "r") -> str:
    return await side.runner.call(lambda: side.engine._requests[request_id].status.value)


async def resumed_here(a, old, tokens: list[int], park: bool = True):
    """The client of `old` left (its request aborted) and its frontend resumed it on `a`: the new copy, one token
    read, and with `park` parked by its own PD hand-off, with the state it parked it with."""
    await a.runner.abort("r")
    new = await a.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens), attempt=2)
    await read(new, tokens, until=len(tokens) + 1)
    held = await a.runner.call(lambda: a.engine.hold_and_export("r")) if park else None
    assert new is not old and (held is not None or not park)
    return new, held


@pytest.mark.parametrize("copy_fails", [True, False], ids=["its_copy_fails", "it_looks_again"])
async def test_a_migration_whose_copy_was_replaced_leaves_the_new_copy_parked(pair, copy_fails):
    """The migration's stage was under way when its copy was aborted and the request resumed here; it then fails
    (its transfer, or its next look at the request). Before, its abandon resumed the request by id: the new copy,
    which its PD hand-off had parked (and which that hand-off moves, with the state it parked it with)."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    old = await a.runner.add("r", PROMPT, SAMPLING, attempt=1)
    await read(old, tokens, until=30)
    copier = TensorCopier(a, b, fail_on=1 if copy_fails else None, pause=asyncio.Event())
    mover = driver(a, FaultyPeer(b), copier)
    migration = asyncio.create_task(mover.migrate_out(plan()))
    while not copier.num_calls:  # in its first live stage
        await asyncio.sleep(0.01)
    new, held = await resumed_here(a, old, tokens)
    pusher = DecodeHandoff("a", a.runner, mover, DecodePlacer(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    pusher.note_prefilled("r", held)
    copier.pause.set()
    with pytest.raises(Unavailable if copy_fails else Aborted):
        await migration
    assert await status(a) == "suspended"  # still parked: the hand-off's, not the failed migration's
    await pusher._hand_off("r")  # moves it with the state it parked it with
    handoff = await asyncio.wait_for(read(new, tokens), 10)
    assert isinstance(handoff, Handoff) and handoff.next_token_index == len(tokens)
    await asyncio.wait_for(read(b.inbox.attach("r", handoff.epoch), tokens), 30)
    assert tokens == expected
    await assert_no_blocks_held(a, b)


async def test_a_hand_off_after_its_copy_was_replaced_during_the_commit_releases_nothing(pair):
    """The migration committed the aborted copy; a new copy of the request, parked by its PD hand-off, took the id
    here meanwhile. Before, the hand-off released the request by id: the new copy left the engine while its stream
    stayed open, and its client waited for tokens that never came."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    old = await a.runner.add("r", PROMPT, SAMPLING, attempt=1)
    await read(old, tokens, until=30)
    peer, copies = FaultyPeer(b), []
    plain_commit = peer.commit_migrate_in

    async def commit_as_the_client_resumes_here(migration_id, state, attempt=0) -> None:
        copies.append(await resumed_here(a, old, tokens))
        await plain_commit(migration_id, state, attempt=attempt)

    peer.commit_migrate_in = commit_as_the_client_resumes_here
    await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    assert await status(a) == "suspended"  # the new copy: still here, parked
    assert b.runner.stream("r") is None and peer.calls[-1] == "abort_migrate_in"  # the old one's: nobody follows it
    new, _ = copies[0]
    assert await a.runner.resume(new)  # its hand-off found no decode instance: it decodes here
    last = await asyncio.wait_for(read(new, tokens), 30)
    assert last.finish_reason is FinishReason.LENGTH and tokens == expected
    await assert_no_blocks_held(a, b)


async def test_a_pd_hand_off_whose_copy_was_replaced_while_it_asked_for_a_place_leaves_the_new_copy_alone(pair):
    """The hand-off's request was aborted and resumed here while the manager chose its decode instance. Before, it
    then migrated whatever copy had the id: the new copy, which it had not parked and its worker had not taken."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    old = await a.runner.add("r", PROMPT, SAMPLING, attempt=1)
    await read(old, tokens, until=30)
    placer = SlowDecodePlacer()
    pusher = DecodeHandoff("a", a.runner, driver(a, FaultyPeer(b), TensorCopier(a, b)), placer, PdHandoff.PUSH,
                           lambda: InstanceRole.PREFILL)
    pusher.note_prefilled("r", await a.runner.call(lambda: a.engine.hold_and_export("r")))
    pushing = asyncio.create_task(pusher._hand_off("r"))  # a worker takes it and asks for a place
    await placer.asked.wait()
    new, _ = await resumed_here(a, old, tokens, park=False)
    placer.answer.set()
    await pushing
    last = await asyncio.wait_for(read(new, tokens), 30)
    assert last.finish_reason is FinishReason.LENGTH and tokens == expected  # here, to its end: not handed off
    assert b.runner.stream("r") is None
    await assert_no_blocks_held(a, b)
