"""RequestRunner following live-migration hand-offs: Attach, epochs, fallbacks, aborts (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Aborted, NotFound, Unavailable
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import CopyRef, FinishReason, InstanceId, Target
from services.frontend.request_runner import RequestRunner

from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, chunk, decode, handoff, make_spec, make_state

pytestmark = pytest.mark.timeout(10)

STOP = FinishReason.STOP


class ManagerPicks:
    """A manager that answers each Dispatch with the next instance of a list."""

    def __init__(self, *instance_ids: str) -> None:
        self.picks = list(instance_ids)
        self.excluded: list[tuple[str, ...]] = []

    async def dispatch(self, spec, exclude):
        self.excluded.append(tuple(exclude))
        instance_id = self.picks.pop(0)
        return Target(InstanceId(instance_id), f"addr-{instance_id}")


def make_runner(instances, *picks, max_handoffs=16, max_resumes=3):
    dispatcher = Dispatcher(ManagerPicks(*picks), FakeMembership(), cooldown_s=5.0)
    counts = {"handoffs": 0, "resumes": 0}
    runner = RequestRunner(dispatcher, instances, max_resumes=max_resumes, max_handoffs=max_handoffs,
                           resume_backoff_s=0, on_resume=lambda: counts.__setitem__("resumes", counts["resumes"] + 1),
                           on_handoff=lambda: counts.__setitem__("handoffs", counts["handoffs"] + 1))
    return runner, counts


async def run(runner, state=None):
    state = state or make_state()
    await runner.run(state, make_spec())
    return state


def assert_one_stream(state, token_ids):
    assert state.token_ids == token_ids
    assert state.text == decode(token_ids)  # text deltas continuous: nothing lost, nothing repeated


async def test_a_handoff_continues_on_the_destination_as_one_stream():
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4, 5), chunk(2, 6), handoff(3, "b", 1)], None)},
        {"b": ([chunk(3, 7, epoch=1), chunk(4, 8, epoch=1, finish=STOP)], None)})
    runner, counts = make_runner(instances, "a")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6, 7, 8])
    assert state.finish_reason is STOP and state.num_handoffs == 1 and counts == {"handoffs": 1, "resumes": 0}
    assert instances.attaches == [("b", "cmpl-1", 3, 1)]
    assert instances.aborted == []  # the source ended its stream cleanly; the destination finished it


async def test_the_handoff_chunk_may_carry_the_last_source_tokens():
    instances = ScriptedInstances({"a": ([chunk(0, 4), handoff(1, "b", 1, 5, 6)], None)},
                                  {"b": ([chunk(3, 7, epoch=1, finish=STOP)], None)})
    runner, _ = make_runner(instances, "a")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6, 7])
    assert instances.attaches == [("b", "cmpl-1", 3, 1)]


async def test_repeats_and_older_epochs_from_the_destination_are_dropped():
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4, 5, 6), handoff(3, "b", 2)], None)},
        # b re-sends tokens 1..3 (held already), a stale chunk of epoch 1, then continues
        {"b": ([chunk(1, 5, 6, 7, epoch=2), chunk(4, 99, epoch=1), chunk(4, 8, epoch=2, finish=STOP)], None)})
    runner, _ = make_runner(instances, "a")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6, 7, 8])


async def test_a_request_migrated_twice_comes_back_to_its_first_instance():
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4), handoff(1, "b", 1)], None)},
        {"b": ([chunk(1, 5, epoch=1), handoff(2, "a", 2, from_epoch=1)], None),
         "a": ([chunk(2, 6, epoch=2, finish=STOP)], None)})
    runner, counts = make_runner(instances, "a")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6])
    assert instances.attaches == [("b", "cmpl-1", 1, 1), ("a", "cmpl-1", 2, 2)]
    assert counts["handoffs"] == 2 and instances.aborted == []


@pytest.mark.parametrize("error", [Unavailable("b died right after commit"), NotFound("no such request"),
                                   Aborted("stale epoch")])
async def test_a_failed_attach_falls_back_to_resume_elsewhere(error):
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4, 5), handoff(2, "b", 1)], None), "c": ([chunk(2, 6, finish=STOP)], None)},
        {"b": ([], error)})
    runner, counts = make_runner(instances, "a", "c")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6])
    assert [(i, s.resume_token_ids) for i, s in instances.specs] == [("a", ()), ("c", (4, 5))]
    assert instances.aborted == [("b", "cmpl-1")]  # the owner after the hand-off frees what it holds
    assert runner._dispatcher._manager.excluded == [(), ("b",)]  # the destination that failed is avoided
    assert counts == {"handoffs": 1, "resumes": 1}


async def test_a_destination_that_breaks_mid_stream_is_resumed_from_the_tokens_held():
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4), handoff(1, "b", 1)], None), "c": ([chunk(3, 7, finish=STOP)], None)},
        {"b": ([chunk(1, 5, 6, epoch=1)], Unavailable("b went away"))})
    runner, _ = make_runner(instances, "a", "c")
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6, 7])
    assert instances.specs[-1][1].resume_token_ids == (4, 5, 6) and instances.aborted == [("b", "cmpl-1")]
    # the copy b held: attempt 1's, at the epoch the hand-off gave it (a late Abort leaves a newer one alone)
    assert instances.aborted_copies == [CopyRef(1, 1)] and instances.specs[-1][1].attempt == 2


async def test_handoffs_with_no_token_between_are_bounded_then_the_request_resumes_elsewhere():
    ping = ([handoff(1, "a", 2, from_epoch=1)], None)  # b hands it back before a new token
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4), handoff(1, "b", 1)], None), "c": ([chunk(1, 5, finish=STOP)], None)},
        {"b": [ping]})
    runner, counts = make_runner(instances, "a", "c", max_handoffs=1)
    state = await run(runner)
    assert_one_stream(state, [4, 5])
    assert instances.attaches == [("b", "cmpl-1", 1, 1)]  # the second hand-off (to a) is not followed
    assert instances.aborted == [("a", "cmpl-1")]  # a owns it after the second hand-off: a frees it
    assert counts == {"handoffs": 2, "resumes": 1}


async def test_handoffs_with_progress_between_are_followed_however_many():
    instances = ScriptedInstances(
        {"a": ([chunk(0, 4), handoff(1, "b", 1)], None)},
        {"b": [([chunk(1, 5, epoch=1), handoff(2, "a", 2, from_epoch=1)], None),
               ([chunk(3, 7, epoch=3), chunk(4, 8, epoch=3, finish=STOP)], None)],
         "a": [([chunk(2, 6, epoch=2), handoff(3, "b", 3, from_epoch=2)], None)]})
    runner, counts = make_runner(instances, "a", max_handoffs=1)
    state = await run(runner)
    assert_one_stream(state, [4, 5, 6, 7, 8])
    assert state.num_handoffs == 3 and counts == {"handoffs": 3, "resumes": 0}


async def test_a_client_that_leaves_while_attached_aborts_on_the_destination():
    gate = asyncio.Event()

    class Slow(ScriptedInstances):
        async def attach(self, target, request_id, from_token_index, epoch):
            self.attaches.append((target.instance_id, request_id, from_token_index, epoch))
            yield chunk(1, 5, epoch=1)
            await gate.wait()

    instances = Slow({"a": ([chunk(0, 4), handoff(1, "b", 1)], None)})
    runner, _ = make_runner(instances, "a")
    state = make_state()
    task = asyncio.create_task(runner.run(state, make_spec()))
    while len(state.token_ids) < 2:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert instances.aborted == [("b", "cmpl-1")]


async def test_an_abort_still_being_tried_is_called_off_when_the_request_is_handed_there_again():
    # The frontend tries an Abort the instance did not answer up to 3 times; landing after the request
    # was handed to that instance again, it ended the new hand-off (found by review).
    events = []

    class SlowAborts(ScriptedInstances):
        async def attach(self, target, request_id, from_token_index, epoch):
            events.append(("attach", target.instance_id, epoch))
            async for item in super().attach(target, request_id, from_token_index, epoch):
                await asyncio.sleep(0.2)
                yield item

        def abort_soon(self, target, request_id, copy=None):
            async def land():
                await asyncio.sleep(0.3)  # a second try, 0.25 s after a refused first
                events.append(("abort_landed", target.instance_id))
            return asyncio.get_running_loop().create_task(land())

    instances = SlowAborts(
        {"p1": ([chunk(0, 4), handoff(1, "d", 1)], None), "p2": ([handoff(1, "d", 2, from_epoch=0)], None)},
        {"d": [([], Unavailable("d did not answer the Attach")),
               ([chunk(1, 5, epoch=2), chunk(2, 6, epoch=2, finish=FinishReason.STOP)], None)]})
    dispatcher = Dispatcher(ManagerPicks("p1", "p2"), FakeMembership(), cooldown_s=5.0)
    runner = RequestRunner(dispatcher, instances, max_resumes=3, resume_backoff_s=0, lone_resume_backoff_s=0)
    state = make_state()
    await runner.run(state, make_spec())
    await asyncio.sleep(0.5)
    assert state.error is None and state.token_ids == [4, 5, 6]
    assert ("abort_landed", "d") not in events[events.index(("attach", "d", 2)):]
