"""RequestRunner: resume after a broken stream, bounded, with aborts (no sockets)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from services.common.errors import Internal, InvalidArgument, ResourceExhausted, Unavailable
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import CopyRef, FinishReason
from services.frontend.request_runner import RequestRunner

from tests.unit.frontend.factories import (BreaksOnce, FakeManager, FakeMembership, ScriptedInstances, chunk, entry,
                                           make_spec, make_state)

pytestmark = pytest.mark.timeout(10)


def make_runner(scripts, *instance_ids, max_resumes=3):
    instances = ScriptedInstances(scripts)
    dispatcher = Dispatcher(None, FakeMembership(*(entry(i) for i in instance_ids)), cooldown_s=5.0)
    resumes = []
    runner = RequestRunner(dispatcher, instances, max_resumes=max_resumes, resume_backoff_s=0, no_instance_wait_s=0.2,
                           on_resume=lambda: resumes.append(1))
    return runner, instances, resumes


async def test_a_whole_stream_finishes_without_aborts():
    runner, instances, _ = make_runner({"a": ([chunk(0, 4, 5), chunk(2, 6, finish=FinishReason.STOP)], None)}, "a")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5, 6] and state.finish_reason is FinishReason.STOP
    assert instances.aborted == []


async def test_a_broken_stream_resumes_elsewhere_with_the_tokens_so_far():
    scripts = {
        "a": ([chunk(0, 4, 5)], Unavailable("instance a died")),
        # b repeats token 1 (already held) and continues: the repeat is dropped
        "b": ([chunk(1, 5, 6), chunk(3, 7, finish=FinishReason.LENGTH)], None),
    }
    runner, instances, resumes = make_runner(scripts, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5, 6, 7] and state.finish_reason is FinishReason.LENGTH
    assert [(i, s.resume_token_ids) for i, s in instances.specs] == [("a", ()), ("b", (4, 5))]
    assert instances.aborted == [("a", "cmpl-1")]
    assert state.num_resumes == 1 and resumes == [1]


async def test_a_resume_sends_back_where_the_first_instance_computed_the_prompt_from():
    """The instance says where it first computed the prompt from (the tokens before came from its cache); a
    resume elsewhere sends that back, so the prompt is cut there again and the tokens keep their bits."""
    started = replace(chunk(0, 4, 5), first_start=2)
    scripts = {"a": ([started], Unavailable("instance a died")),
               "b": ([replace(chunk(2, 6, finish=FinishReason.STOP), first_start=2)], None)}
    runner, instances, _ = make_runner(scripts, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert [(i, s.resume_first_start) for i, s in instances.specs] == [("a", None), ("b", 2)]
    assert state.token_ids == [4, 5, 6]


async def test_a_stream_that_ends_without_a_finish_is_resumed():
    scripts = {"a": ([chunk(0, 4)], None), "b": ([chunk(1, 5, finish=FinishReason.STOP)], None)}
    runner, instances, _ = make_runner(scripts, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5] and [i for i, _ in instances.specs] == ["a", "b"]


async def test_resumes_are_bounded_then_an_explicit_error():
    scripts = {name: ([], Unavailable(f"{name} down")) for name in "abcd"}
    runner, _, _ = make_runner(scripts, *"abcd", max_resumes=2)
    state = make_state()
    await runner.run(state, make_spec())
    assert isinstance(state.error, Unavailable)
    assert "after 2 resumes (--max-resumes 2)" in state.error.message


async def test_the_only_instance_is_tried_again_after_its_abort():
    instances = BreaksOnce({})
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5), instances, max_resumes=3,
                           resume_backoff_s=0, lone_resume_backoff_s=0.3)
    state = make_state()
    started = asyncio.get_running_loop().time()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5] and instances.aborted == [("a", "cmpl-1")]
    assert [s.resume_token_ids for _, s in instances.specs] == [(), (4,)]
    # each Generate is an attempt, and the Abort names the copy it ends: one landing late (the instance was frozen)
    # leaves the resumed copy alone there (before, it could end it)
    assert [s.attempt for _, s in instances.specs] == [1, 2] and instances.aborted_copies == [CopyRef(1, 0)]
    # nothing else serves: it waited the long backoff (time for a supervisor to restart the instance)
    assert asyncio.get_running_loop().time() - started >= 0.3


async def test_with_another_instance_serving_a_resume_waits_only_the_short_backoff():
    scripts = {"a": ([chunk(0, 4)], Unavailable("a died")), "b": ([chunk(1, 5, finish=FinishReason.STOP)], None)}
    instances = ScriptedInstances(scripts)
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a"), entry("b")), cooldown_s=5), instances,
                           max_resumes=3, resume_backoff_s=0, lone_resume_backoff_s=5.0)
    state = make_state()
    await asyncio.wait_for(runner.run(state, make_spec()), 2.0)
    assert state.token_ids == [4, 5]


async def test_an_empty_cluster_fails_with_the_dispatch_error():
    runner, _, _ = make_runner({}, max_resumes=3)
    state = make_state()
    await runner.run(state, make_spec())
    assert isinstance(state.error, Unavailable) and "no serving instance" in state.error.message


async def test_a_new_request_that_finds_no_instance_for_a_moment_waits_for_one():
    """etcd back from a freeze longer than every lease's TTL revokes them all: for the moment until the
    instances register again the frontend knows none, and a new request sent then got a 503 at once
    (found by a PD chaos run freezing etcd for 5.5 s). It now looks again for up to 2 s."""
    membership = FakeMembership()
    asyncio.get_running_loop().call_later(0.15, lambda: membership.entries.append(entry("a")))  # registered again
    runner = RequestRunner(Dispatcher(None, membership, cooldown_s=5),
                           ScriptedInstances({"a": ([chunk(0, 4, finish=FinishReason.STOP)], None)}), max_resumes=3)
    state = make_state()
    started = asyncio.get_running_loop().time()
    await runner.run(state, make_spec())
    assert state.error is None, state.error.message
    assert state.token_ids == [4] and state.num_resumes == 0
    assert asyncio.get_running_loop().time() - started < 1.0  # as soon as one is there


async def test_a_new_request_waits_for_no_instance_while_some_are_registered_but_drained():
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a", is_serving=False)), cooldown_s=5),
                           ScriptedInstances({}), max_resumes=3)
    state = make_state()
    await asyncio.wait_for(runner.run(state, make_spec()), 0.5)
    assert isinstance(state.error, Unavailable) and "none serving" in state.error.message


async def test_other_errors_fail_at_once():
    error = InvalidArgument("bad")
    runner, instances, _ = make_runner({"a": ([], error), "b": ([], None)}, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.error is error and [i for i, _ in instances.specs] == ["a"]


async def test_an_instance_with_a_full_queue_sends_the_request_to_another():
    runner, instances, _ = make_runner({"a": ([], ResourceExhausted("full")),
                                        "b": ([chunk(0, 4, finish=FinishReason.STOP)], None)}, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.error is None and state.token_ids == [4] and [i for i, _ in instances.specs] == ["a", "b"]


async def test_full_everywhere_is_the_last_refusal():
    full = ResourceExhausted("full")
    runner, instances, _ = make_runner({"a": ([], full), "b": ([], full)}, "a", "b")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.error is full and sorted(i for i, _ in instances.specs) == ["a", "b"]


async def test_a_full_cluster_logs_one_trying_another_line_per_instance():
    """Before, each refused attempt logged instance_full_trying_another: a full cluster flooded the log."""
    full = ResourceExhausted("full")
    runner, _, _ = make_runner({"a": ([], full), "b": ([], full)}, "a", "b")
    with capture_logs() as logs:
        for _ in range(10):
            state = make_state()
            await runner.run(state, make_spec())
            assert state.error is full
    lines = [(e["instance_id"], e["suppressed"]) for e in logs if e["event"] == "instance_full_trying_another"]
    assert lines and len(lines) == len({i for i, _ in lines}) and {s for _, s in lines} == {0}


async def test_cancelling_the_runner_aborts_on_the_instance():
    gate = asyncio.Event()

    class Slow(ScriptedInstances):
        async def generate(self, target, spec):
            yield chunk(0, 4)
            await gate.wait()

    instances = Slow({})
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5), instances, max_resumes=3)
    state = make_state()
    task = asyncio.create_task(runner.run(state, make_spec()))
    while not state.token_ids:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert instances.aborted == [("a", "cmpl-1")]


async def test_chunks_of_an_older_epoch_are_dropped():
    scripts = {"a": ([chunk(0, 4, epoch=2), chunk(1, 9, epoch=1), chunk(1, 5, epoch=2, finish=FinishReason.STOP)],
                     None)}
    runner, _, _ = make_runner(scripts, "a")
    state = make_state()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5]


async def test_an_unseeded_sampled_request_keeps_one_seed_across_a_resume():
    scripts = {"a": ([chunk(0, 4)], Unavailable("instance a died")),
               "b": ([chunk(1, 5, finish=FinishReason.STOP)], None)}
    runner, instances, _ = make_runner(scripts, "a", "b")
    sampled = replace(make_spec(), sampling=replace(make_spec().sampling, temperature=0.8, seed=None))
    await runner.run(make_state(), sampled)
    seeds = [s.sampling.seed for _, s in instances.specs]
    assert len(seeds) == 2 and seeds[0] is not None and seeds[0] == seeds[1]


async def test_a_client_seed_and_greedy_requests_are_left_alone():
    scripts = {"a": ([chunk(0, 4, finish=FinishReason.STOP)], None)}
    runner, instances, _ = make_runner(scripts, "a")
    seeded = replace(make_spec(), sampling=replace(make_spec().sampling, temperature=0.8, seed=7))
    await runner.run(make_state(), seeded)
    await runner.run(make_state(), make_spec())
    assert [s.sampling.seed for _, s in instances.specs] == [7, None]


async def test_a_bug_while_serving_fails_the_request_instead_of_leaving_it_waiting():
    """An unexpected exception (here a stop string protobuf cannot encode) must reach the
    client as an error, and the instance that had the request gets its Abort."""
    class Broken(ScriptedInstances):
        async def generate(self, target, spec):
            self.specs.append((target.instance_id, spec))
            yield chunk(0, 4)
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    instances = Broken({})
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5), instances, max_resumes=3,
                           resume_backoff_s=0)
    state = make_state()
    await asyncio.wait_for(runner.run(state, make_spec()), 5)
    assert isinstance(state.error, Internal) and "UnicodeEncodeError" in state.error.message
    assert state.is_done and instances.aborted == [("a", "cmpl-1")]


async def test_a_client_leaving_while_the_resume_waits_for_an_abort_does_not_cancel_it():
    """The only instance broke a stream; the resume waits for the Abort of the first try. A client
    that leaves then must not cancel that Abort (it frees the request's blocks there)."""
    abort_tasks = []
    release = asyncio.Event()

    class SlowAborts(ScriptedInstances):
        def abort_soon(self, target, request_id, copy=None):
            super().abort_soon(target, request_id, copy)

            async def abort():
                await release.wait()  # the Abort RPC in flight (a busy instance, a slow network)
            task = asyncio.get_running_loop().create_task(abort())
            abort_tasks.append(task)
            return task

    instances = SlowAborts({"a": ([chunk(0, 4)], Unavailable("stream broke"))})
    runner = RequestRunner(Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5), instances,
                           max_resumes=3, resume_backoff_s=0, lone_resume_backoff_s=0)
    state = make_state()
    task = asyncio.create_task(runner.run(state, make_spec()))
    while not abort_tasks:
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)  # the runner now awaits the abort before Generate on "a" again
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not abort_tasks[0].cancelled(), "the in-flight Abort of the first try was cancelled with the runner"


async def test_resume_dispatch_tells_the_manager_about_the_resumed_tokens():
    """The manager places a resume by its whole length (prompt + tokens so far) and what is left to generate."""
    manager = FakeManager(None)  # no answer: the local fallback places it, but we see what was asked
    instances = ScriptedInstances({"a": ([chunk(0, 4, 5, 6)], Unavailable("died")),
                                   "b": ([chunk(3, 7, finish=FinishReason.STOP)], None)})
    dispatcher = Dispatcher(manager, FakeMembership(entry("a"), entry("b")), cooldown_s=5)
    runner = RequestRunner(dispatcher, instances, max_resumes=3, resume_backoff_s=0)
    state = make_state()
    await runner.run(state, make_spec())
    assert state.token_ids == [4, 5, 6, 7]
    assert [spec.resume_token_ids for spec, _ in manager.calls] == [(), (4, 5, 6)]


async def test_a_resume_that_finds_no_instance_for_a_moment_waits_for_it_within_its_resumes():
    """One instance, restarted: its key leaves etcd before the restart registers it again. A resume
    that finds nobody waits for it (spending no resume) instead of failing."""
    membership = FakeMembership(entry("a"))

    class Restarting(ScriptedInstances):
        def __init__(self):
            super().__init__({})
            self.calls = 0

        async def generate(self, target, spec):
            self.specs.append((target.instance_id, spec))
            self.calls += 1
            if self.calls == 1:
                yield chunk(0, 4)
                membership.entries = []  # killed: its key goes with its lease ...
                asyncio.get_running_loop().call_later(0.15, lambda: membership.entries.append(entry("a")))  # ... restarted
                raise Unavailable("instance a died")
            yield chunk(len(spec.resume_token_ids), 5, finish=FinishReason.STOP)

    instances = Restarting()
    runner = RequestRunner(Dispatcher(None, membership, cooldown_s=5), instances, max_resumes=3,
                           resume_backoff_s=0.1, lone_resume_backoff_s=0.1)
    state = make_state()
    await runner.run(state, make_spec())
    assert state.error is None, f"failed after {state.num_resumes} of 3 resumes: {state.error.message}"
    assert state.token_ids == [4, 5]


class LoneRestarting(ScriptedInstances):
    """Instance "a": token 4, then it dies (its key leaves `membership`); back `down_s` later; the resume ends with 5.
    While it is down but still listed (`listed_while_down`: its lease not yet lapsed) a Generate fails at once."""

    def __init__(self, membership, down_s, listed_while_down=False):
        super().__init__({})
        self.membership, self.down_s, self.listed_while_down, self.is_down = membership, down_s, listed_while_down, False

    async def generate(self, target, spec):
        self.specs.append((target.instance_id, spec))
        if self.is_down:
            raise Unavailable("failed to connect to all addresses: Connection refused")
        if len(self.specs) > 1:
            yield chunk(len(spec.resume_token_ids), 5, finish=FinishReason.STOP)
            return
        yield chunk(0, 4)
        self.is_down = True
        if not self.listed_while_down:
            self.membership.entries = []
        asyncio.get_running_loop().call_later(self.down_s, self.come_back)
        raise Unavailable("instance a died")

    def come_back(self):
        self.is_down = False
        self.membership.entries = [entry("a")]


@pytest.mark.parametrize("listed_while_down", [False, True])
async def test_a_resume_waits_for_a_lone_instance_longer_than_its_resumes_would_and_spends_none(listed_while_down):
    """Before, each look that found no instance (or the dead one's address refusing) spent a resume: with
    --max-resumes 1 the request failed at the first. Now the wait spends none, ends as soon as the instance is
    back (not after a growing blind pause), and logs resume_waiting_for_instance once."""
    membership = FakeMembership(entry("a"))
    instances = LoneRestarting(membership, down_s=0.5, listed_while_down=listed_while_down)
    resumes = []
    runner = RequestRunner(Dispatcher(None, membership, cooldown_s=5), instances, max_resumes=1,
                           resume_backoff_s=0, lone_resume_backoff_s=0.05, resume_wait_s=5.0,
                           on_resume=lambda: resumes.append(1))
    state = make_state()
    started = asyncio.get_running_loop().time()
    with capture_logs() as logs:
        await runner.run(state, make_spec())
    took_s = asyncio.get_running_loop().time() - started
    assert state.error is None, state.error.message
    assert state.token_ids == [4, 5] and state.num_resumes == 1 and resumes == [1]
    assert 0.5 <= took_s < 1.5, took_s
    assert [e["event"] for e in logs].count("resume_waiting_for_instance") == 1


async def test_a_resume_waits_for_an_instance_no_longer_than_resume_wait_s():
    membership = FakeMembership(entry("a"))
    runner = RequestRunner(Dispatcher(None, membership, cooldown_s=5), LoneRestarting(membership, down_s=60),
                           max_resumes=3, resume_backoff_s=0, lone_resume_backoff_s=0.05, resume_wait_s=0.3)
    state = make_state()
    started = asyncio.get_running_loop().time()
    await runner.run(state, make_spec())
    assert 0.3 <= asyncio.get_running_loop().time() - started < 1.0
    assert isinstance(state.error, Unavailable) and "--resume-wait-s" in state.error.message
    assert "no serving instance is known" in state.error.message and state.num_resumes == 1


async def test_a_client_that_goes_away_ends_the_wait_for_an_instance_at_once():
    membership = FakeMembership(entry("a"))
    runner = RequestRunner(Dispatcher(None, membership, cooldown_s=5), LoneRestarting(membership, down_s=60),
                           max_resumes=3, resume_backoff_s=0, lone_resume_backoff_s=0.05, resume_wait_s=30)
    task = asyncio.create_task(runner.run(make_state(), make_spec()))
    await asyncio.sleep(0.3)
    assert not task.done()  # waiting for the instance
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 0.5)


async def test_a_full_instance_does_not_cost_a_later_failure_its_resume():
    class FullThenDies(ScriptedInstances):
        async def generate(self, target, spec):
            self.specs.append((target.instance_id, spec))
            if len(self.specs) == 1:
                raise ResourceExhausted("1024 requests are already waiting (--max-waiting-requests 1024)")
            if len(self.specs) == 2:
                yield chunk(0, 4, 5)
                raise Unavailable("instance died mid-stream")
            yield chunk(2, 6, finish=FinishReason.STOP)

    instances = FullThenDies({})
    runner = RequestRunner(Dispatcher(None, FakeMembership(*(entry(i) for i in "abc")), cooldown_s=5.0), instances,
                           max_resumes=1, resume_backoff_s=0)
    state = make_state()
    await runner.run(state, make_spec())
    assert state.error is None and state.token_ids == [4, 5, 6] and state.num_resumes == 1
