"""Dispatcher: the manager first, then round robin over our own view (no sockets)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.election import LeaderView
from services.common.errors import Unavailable
from services.frontend.dispatch import Dispatcher, InstanceEntry
from services.frontend.etcd_view import EtcdInstances, EtcdLeader, instance_entry
from services.frontend.generation import InstanceId, Target
from services.frontend.manager_client import ManagerClient

from tests.unit.frontend.factories import FakeManager, FakeMembership, entry, make_spec

pytestmark = pytest.mark.timeout(10)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def make_dispatcher(manager=None, *entries, clock=None):
    fallbacks = []
    dispatcher = Dispatcher(manager, FakeMembership(*entries), cooldown_s=5.0,
                            on_fallback=lambda: fallbacks.append(1), clock=clock or Clock())
    return dispatcher, fallbacks


async def test_the_managers_answer_is_used():
    manager = FakeManager(Target(InstanceId("m1"), "addr-m1"))
    dispatcher, fallbacks = make_dispatcher(manager, entry("a"))
    assert (await dispatcher.pick(make_spec())).instance_id == "m1"
    assert not fallbacks


async def test_no_manager_answer_falls_back_round_robin_over_serving():
    dispatcher, fallbacks = make_dispatcher(FakeManager(None), entry("b"), entry("a"), entry("c", is_serving=False))
    picks = [(await dispatcher.pick(make_spec())).instance_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    assert len(fallbacks) == 4


async def test_an_excluded_instance_is_never_picked_even_if_the_manager_says_so():
    manager = FakeManager(Target(InstanceId("a"), "addr-a"))
    dispatcher, fallbacks = make_dispatcher(manager, entry("a"), entry("b"))
    assert (await dispatcher.pick(make_spec(), exclude=[InstanceId("a")])).instance_id == "b"
    assert manager.calls[0][1] == ("a",)
    assert fallbacks == [1]


async def test_recently_failed_instances_are_skipped_while_others_remain():
    clock = Clock()
    dispatcher, _ = make_dispatcher(None, entry("a"), entry("b"), clock=clock)
    dispatcher.report_failure(InstanceId("a"))
    assert {dispatcher.pick_locally().instance_id for _ in range(3)} == {"b"}
    clock.now += 6
    assert {dispatcher.pick_locally().instance_id for _ in range(4)} == {"a", "b"}


async def test_a_recently_failed_instance_is_still_used_when_it_is_the_only_one():
    dispatcher, _ = make_dispatcher(None, entry("a"))
    dispatcher.report_failure(InstanceId("a"))
    assert dispatcher.pick_locally().instance_id == "a"


def test_failures_are_forgotten_once_their_cooldown_has_passed():
    """Before, one entry per instance id that ever failed stayed for good, though instance ids are fresh
    per start in some deployments (found by a code review)."""
    clock = Clock()
    dispatcher, _ = make_dispatcher(None, entry("a"), clock=clock)
    for i in range(1000):  # instances that failed, each gone since (never looked up again)
        dispatcher.report_failure(InstanceId(f"gone-{i}"))
        clock.now += 1.0
    assert len(dispatcher._failed_at) <= 6  # those within the 5 s cooldown
    dispatcher.report_failure(InstanceId("a"))
    assert dispatcher._recently_failed(InstanceId("a"))


async def test_an_excluded_instance_is_used_when_it_is_the_only_one_serving():
    dispatcher, _ = make_dispatcher(None, entry("a"), entry("b", is_serving=False))
    dispatcher.report_failure(InstanceId("a"))
    assert (await dispatcher.pick(make_spec(), exclude=[InstanceId("a")])).instance_id == "a"


async def test_nothing_known_is_unavailable_with_a_hint():
    dispatcher, _ = make_dispatcher(FakeManager(None))
    with pytest.raises(Unavailable, match="no serving instance.*--etcd-endpoints"):
        await dispatcher.pick(make_spec())
    assert dispatcher.num_serving() == 0


def test_local_fallback_prefers_prefill_capable_instances_and_falls_back_to_decode_ones():
    decode = InstanceEntry(InstanceId("d"), "addr-d", True, is_decode_only=True)
    role_fallbacks = []
    dispatcher = Dispatcher(None, FakeMembership(entry("p"), decode), cooldown_s=5.0,
                            on_role_fallback=lambda: role_fallbacks.append(1), clock=Clock())
    picks = [dispatcher.pick_locally() for _ in range(3)]
    assert {t.instance_id for t in picks} == {"p"} and not any(t.can_prefill_on_decode for t in picks)
    assert not role_fallbacks
    target = dispatcher.pick_locally(exclude=[InstanceId("p")])  # no prefill instance left: decode prefills
    assert target.instance_id == "d" and target.can_prefill_on_decode and role_fallbacks == [1]


def test_the_etcd_record_role_marks_decode_only_entries():
    assert instance_entry("d", {"address": "a:1", "role": "decode"}).is_decode_only
    assert not instance_entry("b", {"address": "a:2"}).is_decode_only


def test_the_longest_sequence_served_is_the_least_any_serving_instance_holds():
    def sized(instance_id: str, max_model_len: int, is_serving: bool = True) -> InstanceEntry:
        return replace(entry(instance_id, is_serving), max_model_len=max_model_len)

    def limit(*entries: InstanceEntry) -> int:
        return Dispatcher(None, FakeMembership(*entries), cooldown_s=1).max_model_len(8192)

    assert limit() == 8192  # no instance known yet: the model's own
    assert limit(sized("a", 0), sized("b", 16384)) == 8192  # unknown, or more than the model
    assert limit(sized("a", 5824), sized("b", 8192)) == 5824  # a's KV cache holds less
    assert limit(sized("a", 1000, is_serving=False), sized("b", 8192)) == 8192  # a is draining or gone
    assert instance_entry("a", {"address": "a:1", "max_model_len": 5824}).max_model_len == 5824
    assert instance_entry("a", {"address": "a:1", "max_model_len": "big"}).max_model_len == 0


def _sized(instance_id: str, max_model_len: int, is_serving: bool = True) -> InstanceEntry:
    return replace(entry(instance_id, is_serving), max_model_len=max_model_len)


async def test_an_instance_serving_shorter_sequences_than_the_request_may_reach_is_never_picked():
    """A black-box run (2026-12-06): a 100-token prompt with max_tokens 300, admitted while only instances of
    448 tokens served, was resumed after its instance's SIGKILL on one of 160 that had joined since, and ended
    after 60 tokens with finish_reason `length` and no error; a 250-token one got `invalid_request_error`
    "shorten the prompt" mid-stream. Such an instance is now passed to the manager as excluded, and an answer
    naming it, or the fallback, never takes it."""
    spec = make_spec(max_tokens=300)  # 3 prompt tokens + 300
    manager = FakeManager(Target(InstanceId("small"), "addr-small"))
    dispatcher, _ = make_dispatcher(manager, _sized("big", 448), _sized("small", 160), _sized("unknown", 0))
    picks = {(await dispatcher.pick(spec)).instance_id for _ in range(4)}
    assert picks == {"big", "unknown"}  # 0: a record without the limit is taken as before
    assert all(set(call[1]) == {"small"} for call in manager.calls)
    assert (await dispatcher.pick(make_spec(max_tokens=150))).instance_id == "small"  # 153 tokens fit there
    assert dispatcher.pick_locally(too_short=[InstanceId("small")]).instance_id != "small"


async def test_a_request_no_serving_instance_can_hold_is_unavailable_saying_so():
    dispatcher, _ = make_dispatcher(FakeManager(None), _sized("big", 448, is_serving=False), _sized("small", 160))
    with pytest.raises(Unavailable, match="no serving instance holds this request's prompt \\+ max_tokens.*160 tokens"):
        await dispatcher.pick(make_spec(max_tokens=300), exclude=[InstanceId("big")])
    # so a resume waits as long as for a lone instance's restart, not the short pause meant for another instance
    assert not dispatcher.serves_besides([InstanceId("big")], make_spec(max_tokens=300))
    assert dispatcher.serves_besides([InstanceId("big")], make_spec(max_tokens=100))
    assert dispatcher.serves_besides([InstanceId("big")])


class FakeView:
    def __init__(self, **members) -> None:
        self.members = members


def test_an_instance_with_a_drain_mark_is_not_serving_in_the_etcd_view():
    instances = FakeView(a={"address": "a:1"}, b={"address": "b:1"})
    membership = EtcdInstances(instances, FakeView(b={"instance_id": "b"}, ghost={"instance_id": "ghost"}))
    assert {e.instance_id: e.is_serving for e in membership.instances()} == {"a": True, "b": False}
    assert [e.is_serving for e in EtcdInstances(instances).instances()] == [True, True]


async def test_the_fallback_never_picks_a_drained_instance_and_says_why_when_all_are():
    marks = FakeView(a={"instance_id": "a"})
    membership = EtcdInstances(FakeView(a={"address": "a:1"}, b={"address": "b:1"}), marks)
    dispatcher = Dispatcher(FakeManager(None), membership, cooldown_s=5.0)
    assert {(await dispatcher.pick(make_spec())).instance_id for _ in range(4)} == {"b"}
    marks.members["b"] = {"instance_id": "b"}
    with pytest.raises(Unavailable, match="2 registered, none serving .*drain ID --undo"):
        await dispatcher.pick(make_spec())


class FakeLeaderKey:
    """The manager/leader key as a MembershipView holds it."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self, member_id: str):
        return self.value


@pytest.mark.parametrize("value", [{"address": "m:1"}, {"leader_id": "m-1"}, ["m:1"]])
async def test_a_malformed_leader_key_sends_dispatch_to_the_fallback_not_the_request_to_a_500(value):
    """Managers outlive such a key (their leader watch keeps the last leader); every request of a
    frontend failed with INTERNAL (a KeyError out of the runner) while it was there."""
    manager = ManagerClient(EtcdLeader(LeaderView(FakeLeaderKey(value))), timeout_s=0.2)
    dispatcher = Dispatcher(manager, FakeMembership(entry("a")), cooldown_s=5.0)
    try:
        assert (await dispatcher.pick(make_spec())).instance_id == "a"
    finally:
        await manager.close()


def _of_vocab(instance_id: str, vocab_size: int, is_serving: bool = True) -> InstanceEntry:
    return replace(entry(instance_id, is_serving), model=f"model-{vocab_size}", vocab_size=vocab_size)


async def test_an_instance_of_another_vocabulary_is_never_picked_nor_counted():
    """A black-box run on three "hosts" (2026-12-07): an instance started with another --model (a tiny
    512-token model beside SmolLM2's 49152) joined the cluster; the load policy sent every request to it, the
    freest, and each got a 400 "token id 3575 is outside the vocabulary [0, 512)" while the two SmolLM2
    instances idled. Such an instance is now passed to the manager as excluded and never taken here."""
    manager = FakeManager(Target(InstanceId("other"), "addr-other"))
    other = replace(_of_vocab("other", 512), max_model_len=100)
    dispatcher = Dispatcher(manager, FakeMembership(other, _of_vocab("ours", 49152),
                                                    _of_vocab("old", 0)), cooldown_s=5.0, vocab_size=49152)
    assert {(await dispatcher.pick(make_spec())).instance_id for _ in range(4)} == {"ours", "old"}  # 0: unknown
    assert all(set(call[1]) == {"other"} for call in manager.calls)
    assert dispatcher.num_serving() == 2
    assert dispatcher.max_model_len(8192) == 8192  # its shorter limit is not the cluster's
    assert not dispatcher.serves_besides([InstanceId("ours"), InstanceId("old")])
    assert Dispatcher(None, FakeMembership(_of_vocab("other", 512)), cooldown_s=1).num_serving() == 1  # unchecked


async def test_a_cluster_of_another_models_instances_alone_is_unavailable_saying_so():
    dispatcher = Dispatcher(FakeManager(None), FakeMembership(_of_vocab("other", 512)), cooldown_s=5.0,
                            vocab_size=49152)
    with pytest.raises(Unavailable, match=r"no serving instance serves this frontend's model: other \(model-512 with "
                                          r"512 tokens\), not this frontend's vocabulary of 49152 tokens.*--model"):
        await dispatcher.pick(make_spec())


async def test_an_instance_of_another_fine_tune_is_never_picked_nor_counted():
    """Two fine-tunes of one base (same vocabulary and layout, other weights): an instance started with the other
    one's folder answered this frontend's requests as that fine-tune, silently. Its record's model fingerprint
    differs from the --model folder's, so it is excluded like another vocabulary's; one without a fingerprint (an
    older instance) is taken, and a frontend whose folder holds no weights checks none."""
    manager = FakeManager(Target(InstanceId("tuned"), "addr-tuned"))
    ours, tuned, old = (replace(_of_vocab(i, 49152), model_fingerprint=f) for i, f in
                        (("ours", "1111111111111111"), ("tuned", "2222222222222222"), ("old", "")))
    dispatcher = Dispatcher(manager, FakeMembership(ours, tuned, old), cooldown_s=5.0, vocab_size=49152,
                            model_fingerprint="1111111111111111")
    assert {(await dispatcher.pick(make_spec())).instance_id for _ in range(4)} == {"ours", "old"}
    assert all(set(call[1]) == {"tuned"} for call in manager.calls)
    assert dispatcher.num_serving() == 2
    alone = Dispatcher(FakeManager(None), FakeMembership(tuned), cooldown_s=5.0, vocab_size=49152,
                       model_fingerprint="1111111111111111")
    with pytest.raises(Unavailable, match=r"tuned \(model-49152 with 49152 tokens, weights 2222222222222222\), not "
                                          r"this frontend's vocabulary of 49152 tokens and weights 1111111111111111"):
        await alone.pick(make_spec())
    assert Dispatcher(None, FakeMembership(tuned), cooldown_s=1, vocab_size=49152).num_serving() == 1  # unchecked


def test_the_etcd_record_names_the_instances_model_and_vocabulary():
    parsed = instance_entry("a", {"address": "a:1", "model": "smollm2", "vocab_size": 49152})
    assert (parsed.model, parsed.vocab_size) == ("smollm2", 49152)
    assert instance_entry("a", {"address": "a:1", "vocab_size": True}).vocab_size == 0
    assert instance_entry("a", {"address": "a:1"}).vocab_size == 0
    assert instance_entry("a", {"address": "a:1", "model_fingerprint": "89c9c3224d2ef4bb"}).model_fingerprint == (
        "89c9c3224d2ef4bb")
    assert instance_entry("a", {"address": "a:1", "model_fingerprint": 7}).model_fingerprint == ""
