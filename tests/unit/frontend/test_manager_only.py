"""A frontend run without etcd (only --manager-address) has no instance list: the manager places
every request. Before, it answered /health with 503 for ever, failed a request an instance refused
as full with 429 at once, and waited the one-instance resume pauses (found by review)."""

from __future__ import annotations

import aiohttp
import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.frontend.dispatch import Dispatcher, NoInstances
from services.frontend.generation import Declined, FinishReason, InstanceId, Target
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.loopback_http import served_on_loopback
from tests.unit.frontend.factories import BreaksOnce, ScriptedInstances, chunk, make_spec, make_state
from tests.unit.frontend.test_request_runner_handoff import ManagerPicks

pytestmark = pytest.mark.timeout(30)


class NoTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1]


async def test_health_is_ok_while_accepting():
    model = ServedModel("m", max_model_len=512, vocab_size=32, tokenizer=NoTokenizer())
    dispatcher = Dispatcher(ManagerPicks(), NoInstances(), cooldown_s=5)
    server = FrontendServer(model, RequestRunner(dispatcher, ScriptedInstances({}), max_resumes=3), dispatcher,
                            FrontendMetrics(), api_keys=(), max_inflight=8, max_body_bytes=1 << 20)
    async with served_on_loopback(server.app()) as base_url, aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/health") as response:
            assert response.status == 200 and (await response.json())["status"] == "ok"
        server.is_accepting = False
        async with session.get(f"{base_url}/health") as response:
            assert response.status == 503


async def test_a_full_instance_sends_the_request_to_the_next_the_manager_picks():
    instances = ScriptedInstances({"a": ([], ResourceExhausted("a is full")),
                                   "b": ([chunk(0, 4, finish=FinishReason.STOP)], None)})
    manager = ManagerPicks("a", "b")
    dispatcher = Dispatcher(manager, NoInstances(), cooldown_s=5)
    state = make_state()
    await RequestRunner(dispatcher, instances, max_resumes=3, resume_backoff_s=0).run(state, make_spec())
    assert state.error is None and state.token_ids == [4]
    assert manager.excluded == [(), ("a",)]


async def test_full_everywhere_is_a_429_not_a_503():
    full = ResourceExhausted("b is full")
    instances = ScriptedInstances({"a": ([], ResourceExhausted("a is full")), "b": ([], full)})

    class TwoInstances:  # the manager places on a, then b, then has none left that is not excluded
        async def dispatch(self, spec, exclude):
            left = [i for i in ("a", "b") if i not in exclude]
            return Target(InstanceId(left[0]), f"addr-{left[0]}") if left else Declined("no serving instance")

    dispatcher = Dispatcher(TwoInstances(), NoInstances(), cooldown_s=5)
    state = make_state()
    await RequestRunner(dispatcher, instances, max_resumes=3, resume_backoff_s=0).run(state, make_spec())
    assert isinstance(state.error, ResourceExhausted) and [i for i, _ in instances.specs] == ["a", "b", "a"]


async def test_a_one_instance_cluster_resumes_on_its_restarted_instance():
    # The manager never places on an excluded instance; without an instance list the frontend asks it
    # again without them, as its own fallback would pick an excluded instance when nothing else serves.
    class LoneInstance:
        async def dispatch(self, spec, exclude):
            return Declined("no serving instance") if "a" in exclude else Target(InstanceId("a"), "addr-a")

    dispatcher = Dispatcher(LoneInstance(), NoInstances(), cooldown_s=5)
    state = make_state()
    await RequestRunner(dispatcher, BreaksOnce({}), max_resumes=3, resume_backoff_s=0,
                        lone_resume_backoff_s=0).run(state, make_spec())
    assert state.error is None and state.token_ids == [4, 5]


async def test_a_manager_that_did_not_answer_is_not_asked_again_without_the_excluded():
    # Only an answer of "none serves" means none does; a call that timed out says nothing (found by review).
    class SlowThenPicks:
        def __init__(self) -> None:
            self.excluded: list[tuple[str, ...]] = []

        async def dispatch(self, spec, exclude):
            self.excluded.append(tuple(exclude))
            return None  # no answer in time

    manager = SlowThenPicks()
    with pytest.raises(Unavailable, match="placed no request"):
        await Dispatcher(manager, NoInstances(), cooldown_s=5).pick(make_spec(), [InstanceId("a")])
    assert manager.excluded == [("a",)]
