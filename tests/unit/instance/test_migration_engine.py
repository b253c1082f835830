"""Live migration at the engine level: two LLMEngines on the same tiny model, KV blocks copied
with a plain tensor copy between their caches (what the transfer service does), the request
exported on A and imported on B. A migrated request must produce exactly the tokens and text
it would have produced unmigrated, and no block may leak on either side."""

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import llguidance
import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.step_output import StepOutput
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.migration_state import MigrationSelection
from services.instance.engine.model import load_model
from services.instance.engine.request import FinishReason, RequestOrigin, RequestStatus, SamplingParams
from services.instance.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5, frequency_penalty=0.5,
                           logit_bias=((3, -100.0), (5, 2.0)), repetition_penalty=1.3, min_p=0.05,
                           max_tokens=MAX_TOKENS, ignore_eos=True)
# Constrained decoding: the destination rebuilds the grammar's state from the output so far.
GUIDED = replace(SEEDED, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z ]{200}"))
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 8, 64, 2]  # 11 tokens: the last prompt block is partial
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def make_engine(tiny) -> Iterator[Callable[..., LLMEngine]]:
    caches: list[KvCache] = []

    def make(num_blocks: int = NUM_BLOCKS, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
             block_size: int = BLOCK_SIZE, max_model_len: int = 256) -> LLMEngine:
        model, tokenizer = tiny
        c = model.config
        geometry = KvGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, num_blocks,
                              torch.float32)
        cache = KvCache.create(f"ferry-kv-test-mig-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry)
        caches.append(cache)
        config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        return LLMEngine(model, tokenizer, cache, config)

    yield make
    for cache in caches:
        cache.close()
        cache.unlink()


@dataclass
class Stream:
    """What a client would have received for one request, across instances."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)  # with SamplingParams.logprobs
    first_start: int | None = None  # as the outputs said (a frontend sends it back on a resume)

    def add(self, output: StepOutput) -> None:
        assert output.token_index == len(self.token_ids), "gap or duplicate token index"
        self.first_start = output.first_start
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs or ()
        self.text += output.text
        self.finish_reason = output.finish_reason


class Harness:
    """Steps engines and collects every request's outputs into its one client stream."""

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}

    def step(self, engine: LLMEngine) -> None:
        for output in engine.step():
            self.streams.setdefault(output.request_id, Stream()).add(output)

    def run_until(self, engine: LLMEngine, request_id: str, num_tokens: int) -> None:
        while len(self.streams.get(request_id, Stream()).token_ids) < num_tokens:
            self.step(engine)

    def finish(self, engine: LLMEngine, request_id: str) -> Stream:
        while self.streams.get(request_id, Stream()).finish_reason is None:
            self.step(engine)
        return self.streams[request_id]


def copy_blocks(src: LLMEngine, dst: LLMEngine, src_ids, dst_ids) -> None:
    """What the transfer service does: every layer's K and V of each block."""
    if src_ids:
        dst.kv_cache.tensor[:, :, list(dst_ids)] = src.kv_cache.tensor[:, :, list(src_ids)]


def migrate(src: LLMEngine, dst: LLMEngine, request_id: str, harness: Harness | None = None,
            num_live_steps: int = 0) -> None:
    """The multi-stage protocol in one process: copy the full blocks while `src` keeps
    decoding `num_live_steps` steps, then suspend, copy the rest, commit, release."""
    migration_id = f"m-{uuid.uuid4().hex[:6]}"
    copied: dict[int, int] = {}
    if num_live_steps:
        view = src.migration_blocks(request_id)
        reserved = dst.reserve_blocks(migration_id, view.num_blocks + 2)
        full = range(view.num_full_blocks)
        copy_blocks(src, dst, [view.block_ids[i] for i in full], [reserved[i] for i in full])
        copied = {i: view.block_ids[i] for i in full}
        for _ in range(num_live_steps):
            harness.step(src)
    view = src.suspend(request_id)
    reserved = dst.reserve_blocks(migration_id, view.num_blocks)
    pending = [i for i in range(view.num_blocks) if copied.get(i) != view.block_ids[i]]
    copy_blocks(src, dst, [view.block_ids[i] for i in pending], [reserved[i] for i in pending])
    state = src.export_state(request_id)
    dst.import_request(migration_id, state, src_instance_id="the-source")
    src.release(request_id)


def unmigrated(make_engine, sampling: SamplingParams, prompt=PROMPT) -> Stream:
    engine, harness = make_engine(), Harness()
    engine.add_request("ref", prompt, sampling)
    return harness.finish(engine, "ref")


def assert_no_blocks_held(*engines: LLMEngine) -> None:
    for engine in engines:
        assert engine.block_manager.num_free_blocks == engine.config.num_blocks
        assert len(engine.reservations) == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALIZED, GUIDED], ids=["greedy", "seeded", "penalized", "guided"])
@pytest.mark.parametrize("num_before", [1, 9, MAX_TOKENS - 1], ids=["first-token", "mid-decode", "near-max-tokens"])
def test_migrated_request_continues_exactly(make_engine, sampling, num_before):
    reference = unmigrated(make_engine, sampling)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, sampling)
    harness.run_until(a, "r", num_before)
    migrate(a, b, "r")
    got = harness.finish(b, "r")
    assert got.token_ids == reference.token_ids
    assert got.text == reference.text and got.finish_reason is FinishReason.LENGTH
    assert_no_blocks_held(a, b)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_migrated_while_queued_moves_without_blocks(make_engine, sampling):
    reference = unmigrated(make_engine, sampling)
    a, b, harness = make_engine(max_num_seqs=1), make_engine(), Harness()
    a.add_request("busy", [9] * 6, GREEDY)
    harness.step(a)  # "busy" takes the only batch slot
    a.add_request("r", PROMPT, sampling)
    harness.step(a)
    assert a.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, exclude=frozenset({"busy"})) == "r"
    assert a.migration_blocks("r").status is RequestStatus.WAITING and a.migration_blocks("r").num_blocks == 0
    migrate(a, b, "r")
    assert harness.finish(b, "r").token_ids == reference.token_ids
    harness.finish(a, "busy")
    assert_no_blocks_held(a, b)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, GUIDED], ids=["greedy", "seeded", "guided"])
def test_migrated_twice_a_to_b_to_a(make_engine, sampling):
    reference = unmigrated(make_engine, sampling)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, sampling)
    harness.run_until(a, "r", 5)
    migrate(a, b, "r")
    harness.run_until(b, "r", 13)
    migrate(b, a, "r")
    got = harness.finish(a, "r")
    assert got.token_ids == reference.token_ids and got.text == reference.text
    assert_no_blocks_held(a, b)


def test_the_load_counts_each_request_taken_in_added_or_migrated_in(make_engine):
    """The manager drops a dispatch's (a PD placement's) reservation once the instance's report counts
    the request added (migrated in); a refused one, a resume of a suspended one or a migration out
    takes nothing in."""
    a, b, harness = make_engine(), make_engine(), Harness()
    assert (a.load().num_requests_admitted, b.load().num_requests_admitted) == (0, 0)
    a.add_request("r", PROMPT, GREEDY)
    with pytest.raises(InvalidArgument):
        a.add_request("r", PROMPT, GREEDY)  # a duplicate id
    with pytest.raises(InvalidArgument):
        a.add_request("bad", [], GREEDY)
    assert a.load().num_requests_admitted == 1 and a.load().num_waiting == 1  # in the same snapshot
    harness.run_until(a, "r", 3)
    a.suspend("r")
    assert a.resume("r") and a.load().num_requests_admitted == 1
    migrate(a, b, "r")
    counts = lambda e: (e.load().num_requests_admitted, e.load().num_requests_migrated_in)  # noqa: E731
    assert (counts(a), counts(b)) == ((1, 0), (0, 1))
    assert b.load().num_running == 1
    migrate(b, a, "r")
    assert (counts(a), counts(b)) == ((1, 1), (0, 1))
    harness.finish(a, "r")
    assert counts(a) == (1, 1)
    assert_no_blocks_held(a, b)


def test_list_requests_says_how_each_request_came(make_engine):
    """The manager counts an unanswered MigrateOut committed only for a request migrated in from its source: a
    resume of the request on the destination (the frontend's failover) is no commit (found by a black-box run)."""
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, GREEDY)
    b.add_request("resumed", PROMPT, GREEDY, resume_token_ids=[5, 6])
    harness.run_until(a, "r", 2)
    migrate(a, b, "r")
    origins = {r.request_id: (r.origin, r.migrated_from) for r in b.list_requests()}
    assert origins == {"r": (RequestOrigin.MIGRATED_IN, "the-source"), "resumed": (RequestOrigin.RESUMED, "")}
    a.add_request("dispatched", PROMPT, GREEDY)
    assert {r.request_id: r.origin for r in a.list_requests()}["dispatched"] is RequestOrigin.DISPATCHED


def test_multi_stage_copy_while_decoding(make_engine):
    reference = unmigrated(make_engine, SEEDED)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, SEEDED)
    a.add_request("other", [3] * 9, GREEDY)  # another request keeps sharing the batch
    harness.run_until(a, "r", 6)
    migrate(a, b, "r", harness, num_live_steps=7)  # crosses block boundaries while live
    assert harness.finish(b, "r").token_ids == reference.token_ids
    harness.finish(a, "other")
    assert_no_blocks_held(a, b)


def test_stop_string_spanning_the_hand_off(make_engine):
    full = unmigrated(make_engine, GREEDY)
    num_before = 8
    engine, harness = make_engine(), Harness()
    engine.add_request("probe", PROMPT, GREEDY)
    harness.run_until(engine, "probe", num_before)
    harness.finish(engine, "probe")
    cut = len(engine.tokenizer.decode(PROMPT + full.token_ids[:num_before])) - len(engine.tokenizer.decode(PROMPT))
    stop = full.text[cut - 2:cut + 2]
    assert len(stop) == 4 and full.text.find(stop) == cut - 2, "pick a stop string that first occurs at the cut"
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=(stop,))
    reference = unmigrated(make_engine, sampling)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, sampling)
    harness.run_until(a, "r", num_before)
    migrate(a, b, "r")
    got = harness.finish(b, "r")
    assert reference.finish_reason is FinishReason.STOP and reference.text == full.text[:cut - 2]
    assert (got.token_ids, got.text, got.finish_reason) == (reference.token_ids, reference.text, FinishReason.STOP)
    assert_no_blocks_held(a, b)


def test_selection_policies(make_engine):
    engine, harness = make_engine(), Harness()
    for request_id, length in (("mid", 8), ("short", 4), ("long", 12)):
        engine.add_request(request_id, [7] * length, GREEDY)
    harness.step(engine)
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING) == "short"
    assert engine.pick_for_migration(MigrationSelection.LONGEST_RUNNING) == "long"
    assert engine.pick_for_migration(MigrationSelection.LAST_COME_FIRST) == "long"
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, exclude=frozenset({"short"})) == "mid"


def test_a_destination_serving_shorter_sequences_gets_a_request_that_fits_it(make_engine):
    """With the destination's max_model_len the pick skips what it would refuse (prompt + max_tokens
    above it): the policy's pick among the rest, or none."""
    engine, harness = make_engine(), Harness()
    for request_id, length in (("mid", 8), ("short", 4), ("long", 12)):  # + MAX_TOKENS: 32, 28, 36
        engine.add_request(request_id, [7] * length, GREEDY)
    harness.step(engine)
    assert engine.pick_for_migration(MigrationSelection.LONGEST_RUNNING, dst_max_model_len=0) == "long"
    assert engine.pick_for_migration(MigrationSelection.LONGEST_RUNNING, dst_max_model_len=32) == "mid"
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, dst_max_model_len=28) == "short"
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, dst_max_model_len=27) is None


def test_shortest_running_moves_the_oldest_queued_request_while_the_batch_is_full(make_engine):
    """A queued request needs no copy and no pause, and it waits here for a slot a destination has now;
    the other selections keep their running picks."""
    engine, harness = make_engine(max_num_seqs=2), Harness()
    for request_id, length in (("short", 4), ("long", 12)):
        engine.add_request(request_id, [7] * length, GREEDY)
    harness.step(engine)
    for request_id in ("queued-1", "queued-2"):
        engine.add_request(request_id, [7] * 2, GREEDY)
    harness.step(engine)
    assert {r.request_id: r.state for r in engine.list_requests()} == {
        "short": "running", "long": "running", "queued-1": "waiting", "queued-2": "waiting"}
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING) == "queued-1"
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, frozenset({"queued-1"})) == "queued-2"
    assert engine.pick_for_migration(MigrationSelection.LONGEST_RUNNING) == "long"
    assert engine.pick_for_migration(MigrationSelection.LAST_COME_FIRST) == "long"
    assert engine.pick_for_migration(MigrationSelection.PREFILL_DONE) == "short"


def test_shortest_running_keeps_a_queued_request_that_a_free_slot_will_admit_here(make_engine):
    """With a slot free the request starts at the next step here: a move would only delay it (and fail
    if it was admitted meanwhile)."""
    engine, harness = make_engine(max_num_seqs=3), Harness()
    for request_id, length in (("short", 4), ("long", 12)):
        engine.add_request(request_id, [7] * length, GREEDY)
    harness.step(engine)
    engine.add_request("queued", [7] * 2, GREEDY)
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING) == "short"


def test_a_queued_request_moving_out_holds_no_batch_slot(make_engine):
    """Before, a suspended waiting request counted as a busy slot: while it moved, a slot freed here went
    unused and the next queued request waited for the move to end."""
    engine, harness = make_engine(max_num_seqs=1), Harness()
    engine.add_request("busy", [9] * 4, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    harness.step(engine)
    engine.add_request("moving", [7] * 2, GREEDY)
    engine.add_request("next", [7] * 3, GREEDY)
    engine.suspend("moving")
    harness.finish(engine, "busy")
    harness.run_until(engine, "next", 1)  # admitted into the freed slot while "moving" is still suspended
    assert {r.request_id: r.state for r in engine.list_requests()}["next"] == "running"
    assert engine.resume("moving") and engine.load().num_waiting == 1


def test_a_request_midway_through_its_prefill_does_not_move(make_engine):
    """Its prompt logprobs so far would not travel; queued, or once it has a token, it moves."""
    engine, harness = make_engine(max_num_batched_tokens=16), Harness()
    engine.add_request("long", [7] * 40, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                        prompt_logprobs=1))
    engine.check_movable("long")  # queued
    harness.step(engine)  # 16 of 40 prompt tokens
    with pytest.raises(FailedPrecondition, match="prefilling \\(16 of 40 prompt tokens computed\\)"):
        engine.suspend("long")
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING) is None
    harness.run_until(engine, "long", 1)
    engine.check_movable("long")
    engine.suspend("long")


def test_a_request_recomputing_after_a_preemption_is_refused_for_what_it_is(make_engine):
    """Black-box run: it was called "prefilling (511 of 6 prompt tokens computed)"."""
    engine, harness = make_engine(), Harness()
    engine.add_request("r", [7] * 6, GREEDY)
    harness.run_until(engine, "r", 3)
    request = engine._requests["r"]
    request.num_computed_tokens = 4  # as the chunked recompute of a preempted request leaves it midway
    with pytest.raises(FailedPrecondition, match=r"recomputing its context after a preemption \(4 of 9 tokens"):
        engine.check_movable("r")


def test_a_higher_priority_request_is_moved_last(make_engine):
    engine, harness = make_engine(), Harness()
    engine.add_request("urgent-short", [7] * 4, GREEDY, priority=1)
    engine.add_request("normal-long", [7] * 12, GREEDY)
    harness.step(engine)
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING) == "normal-long"
    assert engine.pick_for_migration(MigrationSelection.SHORTEST_RUNNING, frozenset({"normal-long"})) == "urgent-short"


def test_a_queued_lower_priority_request_moves_before_a_running_higher_one(make_engine):
    engine, harness = make_engine(max_num_seqs=1), Harness()
    engine.add_request("urgent", [7] * 4, GREEDY, priority=5)
    harness.step(engine)
    engine.add_request("queued", [7] * 4, GREEDY)  # no batch slot: it waits
    harness.step(engine)
    assert {r.request_id: r.state for r in engine.list_requests()} == {"urgent": "running", "queued": "waiting"}
    for selection in (MigrationSelection.SHORTEST_RUNNING, MigrationSelection.LONGEST_RUNNING,
                      MigrationSelection.LAST_COME_FIRST):
        assert engine.pick_for_migration(selection) == "queued"


def test_suspend_resume_and_abort_keep_blocks_accounted(make_engine):
    reference = unmigrated(make_engine, GREEDY)
    engine, harness = make_engine(), Harness()
    engine.add_request("r", PROMPT, GREEDY)
    harness.run_until(engine, "r", 3)
    view = engine.suspend("r")
    assert view.num_computed_tokens == len(PROMPT) + 2 and view.num_full_blocks == 3 and view.num_blocks == 4
    for _ in range(3):
        harness.step(engine)  # suspended: no progress
    assert len(harness.streams["r"].token_ids) == 3
    with pytest.raises(FailedPrecondition):
        engine.suspend("r")
    assert engine.resume("r") and not engine.resume("r")
    assert harness.finish(engine, "r").token_ids == reference.token_ids
    with pytest.raises(NotFound):
        engine.migration_blocks("r")
    engine.add_request("gone", PROMPT, GREEDY)
    harness.run_until(engine, "gone", 2)
    engine.suspend("gone")
    assert engine.abort("gone") and not engine.resume("gone")
    assert_no_blocks_held(engine)


def test_reservations_grow_refuse_and_free(make_engine):
    engine = make_engine(num_blocks=16, max_num_seqs=2)
    first = engine.reserve_blocks("m-1", 4)
    assert engine.reserve_blocks("m-1", 10)[:4] == first and engine.load().num_free_blocks == 6
    with pytest.raises(ResourceExhausted):
        engine.reserve_blocks("m-1", 17)
    assert len(engine.reserve_blocks("m-1", 3)) == 10  # never shrinks
    engine.reserve_blocks("m-2", 0)
    with pytest.raises(ResourceExhausted, match="max-num-seqs"):
        engine.reserve_blocks("m-3", 1)
    with pytest.raises(ResourceExhausted):
        engine.reserve_blocks("m-4", 0)
    assert engine.free_reservation("m-1") and engine.free_reservation("m-2") and not engine.free_reservation("m-1")
    assert_no_blocks_held(engine)


def test_import_checks_the_reservation(make_engine):
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, GREEDY)
    harness.run_until(a, "r", 2)
    a.suspend("r")
    state = a.export_state("r")
    with pytest.raises(NotFound):
        b.import_request("never-reserved", state)
    b.reserve_blocks("m", 1)
    with pytest.raises(Exception, match="num_computed_tokens"):
        b.import_request("m", state)  # 12 computed tokens need 3 blocks
    b.reserve_blocks("m", 3)
    with pytest.raises(InvalidArgument, match="first_start"):
        b.import_request("m", replace(state, first_start=state.num_tokens))
    assert b.free_reservation("m")
    assert a.resume("r")
    harness.finish(a, "r")
    assert_no_blocks_held(a, b)


# Prefill/decode disaggregation: a prefill instance holds a request from its first token until the hand-off.


def test_prefill_done_picks_only_decoding_requests_oldest_first(make_engine):
    engine = make_engine()
    engine.add_request("old", PROMPT, GREEDY)
    engine.step()  # prefilled: first token
    engine.add_request("new", PROMPT, GREEDY)  # waiting: never the PD pick (it would prefill on the decode side)
    assert engine.pick_for_migration(MigrationSelection.PREFILL_DONE) == "old"
    assert engine.pick_for_migration(MigrationSelection.PREFILL_DONE, frozenset({"old"})) is None
    assert engine.decoding_request_ids() == ["old"]
    assert engine.load().num_decoding == 1


def test_a_held_request_stops_decoding_keeps_its_blocks_and_resumes_exactly(make_engine):
    engine, reference = make_engine(), make_engine()
    expected = reference.generate([PROMPT], GREEDY)[0]
    engine.add_request("r", PROMPT, GREEDY)
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    free_before = engine.block_manager.num_free_blocks
    assert engine.hold("r") and engine.load().num_decoding == 0
    assert engine.step() == [] and engine.block_manager.num_free_blocks == free_before  # parked, blocks kept
    view = engine.suspend_held("r")  # the hand-off's stop-and-copy stage takes it as it is
    assert view.num_computed_tokens == len(PROMPT)
    assert engine.export_state("r").output_token_ids == tuple(tokens)
    assert engine.resume("r")  # no decode instance: it decodes here after all
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == expected
    assert not engine.hold("r")  # finished: nothing to hold


def test_a_request_sharing_cached_blocks_migrates_and_its_blocks_are_cached_at_the_destination(make_engine):
    reference = unmigrated(make_engine, GREEDY)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("first", PROMPT, GREEDY)
    harness.run_until(a, "first", 2)
    a.add_request("r", PROMPT, GREEDY)  # starts from first's two full prompt blocks
    harness.run_until(a, "r", 5)
    assert a.block_manager.prefix_cache.stats().num_hit_tokens == 8
    migrate(a, b, "r")
    assert harness.finish(b, "r").token_ids == reference.token_ids
    assert harness.finish(a, "first").token_ids == reference.token_ids  # the shared blocks were only read
    b.add_request("again", PROMPT, GREEDY)  # the migrated request's blocks are cached on b now
    assert harness.finish(b, "again").token_ids == reference.token_ids
    assert b.block_manager.prefix_cache.stats().num_hit_tokens == 8
    assert_no_blocks_held(a, b)


def test_a_request_first_computed_after_a_cached_prompt_keeps_its_bits_when_preempted_after_it_migrated(make_engine):
    """r (an n=2 choice) computed only its 49-token prompt's last token after a's cached prompt blocks; it migrates
    to B, where an earlier request preempts it and evicts its blocks. Its recompute on B cuts the prompt where r
    first started on A (first_start travels with the state): that token alone again, as it was, so r's logprobs
    equal to the bit those of r never migrated nor preempted. Before, B restarted it at its chunk boundary and
    computed that token within the whole prompt: other logprobs from the first token after the preemption."""
    prompt = [(7 * i + 3) % 500 + 1 for i in range(49)]
    sampling = replace(SEEDED, max_tokens=40, logprobs=1, top_k=0)
    first = replace(sampling, seed=1)

    def start_on(engine: LLMEngine, harness: Harness) -> None:
        engine.add_request("a", prompt, first)
        harness.run_until(engine, "a", 1)
        engine.add_request("r", prompt, sampling)  # starts after a's 3 cached prompt blocks
        harness.run_until(engine, "r", 5)

    roomy, reference = make_engine(block_size=16), Harness()
    start_on(roomy, reference)
    a, b, harness = make_engine(block_size=16), make_engine(num_blocks=7, block_size=16), Harness()
    b.add_request("x", [9] * 40, replace(GREEDY, max_tokens=60))  # earlier than r on b: r is the one preempted
    harness.step(b)
    start_on(a, harness)
    migrate(a, b, "r")
    got = harness.finish(b, "r")
    assert b.scheduler.num_preemptions > 0
    assert got.token_ids == reference.finish(roomy, "r").token_ids
    assert got.logprobs == reference.streams["r"].logprobs


def test_a_request_first_computed_after_a_cached_prompt_resumes_elsewhere_with_its_bits(make_engine):
    """r computed only its 49-token prompt's last token after a's cached prompt blocks, and its outputs say so
    (first_start 48). Its instance dies after 5 tokens; the frontend resumes it on another instance with those
    tokens and that first_start: the prompt is cut there again (its last token alone, as it was), so r's later
    logprobs equal to the bit those of r that never failed. Before, the resume did not know where r started and
    computed that token within the whole prompt (other bits on CPUs whose SDPA gives a lone row other bits)."""
    prompt = [(7 * i + 3) % 500 + 1 for i in range(49)]
    sampling = replace(SEEDED, max_tokens=40, logprobs=1, top_k=0)
    roomy, reference = make_engine(block_size=16), Harness()
    roomy.add_request("a", prompt, replace(sampling, seed=1))
    reference.run_until(roomy, "a", 1)
    roomy.add_request("r", prompt, sampling)
    expected = reference.finish(roomy, "r")
    assert expected.first_start == 48
    other, harness = make_engine(block_size=16), Harness()
    harness.streams["r"] = Stream(token_ids=expected.token_ids[:5])  # what the client had
    other.add_request("r", prompt, sampling, resume_token_ids=expected.token_ids[:5], first_start=48)
    got = harness.finish(other, "r")
    assert got.first_start == 48
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs[5:]
    with pytest.raises(InvalidArgument, match="resume_first_start"):
        other.add_request("bad", prompt, sampling, resume_token_ids=expected.token_ids[:5], first_start=54)


def test_a_request_whose_instance_dies_during_its_prefill_after_a_cached_prefix_resumes_elsewhere_with_its_bits(
        make_engine):
    """r's 244-token prompt starts after a's 9 cached prompt blocks (first_start 144) and takes two steps (chunks
    end at multiples of 240). The first step's output for r has no token but says where r started; its instance
    dies before r's first token, and the frontend resumes it elsewhere with that first_start: the prompt is cut
    there again, so r's logprobs equal to the bit those of r that never failed. Before, only an output with a
    token said it: the resume computed the prompt from 0 in chunks of 240 (other logprobs from token 0 on an
    AVX-512 machine, where a first_start of 48 with chunks of 112 gave the same bits either way)."""
    shared = [(7 * i + 3) % 500 + 1 for i in range(145)]
    prompt = shared[:144] + [(11 * i + 5) % 500 + 1 for i in range(100)]
    sampling = replace(SEEDED, max_tokens=8, logprobs=1, top_k=0)

    def start_on(engine: LLMEngine, harness: Harness) -> None:
        engine.add_request("a", shared, replace(sampling, seed=1))
        harness.run_until(engine, "a", 1)
        engine.add_request("r", prompt, sampling)  # starts after a's 9 cached prompt blocks

    roomy, reference = make_engine(block_size=16, max_num_batched_tokens=512), Harness()
    start_on(roomy, reference)
    expected = reference.finish(roomy, "r")
    dying, harness = make_engine(block_size=16, max_num_batched_tokens=512), Harness()
    start_on(dying, harness)
    harness.step(dying)  # r's first chunk, [144, 240)
    died = harness.streams["r"]
    assert (died.token_ids, died.text, died.finish_reason, died.first_start) == ([], "", None, 144)
    other = make_engine(block_size=16, max_num_batched_tokens=512)
    other.add_request("r", prompt, sampling, first_start=died.first_start)  # the resume: no token to send back
    got = harness.finish(other, "r")
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs


def test_only_a_prefill_longer_than_a_step_gets_an_output_without_a_token(make_engine):
    """The start notice (no token, first_start) comes once, in the step that starts a prompt without sampling
    its first token; a prompt computed in one step says first_start with its first token."""
    engine = make_engine(block_size=16)
    engine.add_request("short", PROMPT, GREEDY)
    engine.add_request("long", [(5 * i + 1) % 500 + 1 for i in range(200)], GREEDY)
    outputs = [o for _ in range(4) for o in engine.step()]
    empty = [(o.request_id, o.token_index, o.first_start) for o in outputs if not o.new_token_ids]
    assert empty == [("long", 0, 0)]
    assert all(o.first_start == 0 for o in outputs)
    assert [o.token_index for o in outputs if o.request_id == "long" and o.new_token_ids][0] == 0


def test_a_salted_request_is_cached_under_its_salt_at_the_destination(make_engine):
    salted = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, cache_salt="tenant-a")
    reference = unmigrated(make_engine, salted)
    a, b, harness = make_engine(), make_engine(), Harness()
    a.add_request("r", PROMPT, salted)
    harness.run_until(a, "r", 5)
    migrate(a, b, "r")
    assert harness.finish(b, "r").token_ids == reference.token_ids
    b.add_request("other-tenant", PROMPT, GREEDY)
    harness.finish(b, "other-tenant")
    assert b.block_manager.prefix_cache.stats().num_hit_tokens == 0
    b.add_request("same-tenant", PROMPT, salted)
    assert harness.finish(b, "same-tenant").token_ids == reference.token_ids
    assert b.block_manager.prefix_cache.stats().num_hit_tokens == 8
    assert_no_blocks_held(a, b)


def test_a_request_preempted_by_a_resumed_one_past_the_cache_finishes_and_the_queue_moves(make_engine):
    """H suspended (migrating out), R fills the cache around H's cached prefix, the migration fails and
    H, resumed, preempts R when R has outgrown the cache: R must finish with LENGTH, not hold the
    head of the waiting queue for ever with everything behind it."""
    engine = make_engine(num_blocks=4)
    harness = Harness()
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("H", PROMPT[:8], greedy)
    harness.step(engine)  # H: 2 full (cached) blocks, 1 token sampled
    engine.suspend("H")
    engine.add_request("R", PROMPT[:8] + [9, 10, 11, 12, 13, 14, 15], greedy)  # 15 tokens, H's 2 blocks shared
    harness.step(engine)
    harness.step(engine)  # R: 17 tokens, more than the 16 the cache holds
    assert engine.resume("H")
    engine.add_request("late", [1, 2, 3], greedy)
    for _ in range(50):  # a few steps each; before, R and "late" waited for ever
        harness.step(engine)
    assert harness.streams["R"].finish_reason is FinishReason.LENGTH
    assert harness.streams["late"].token_ids and harness.streams["H"].finish_reason is FinishReason.LENGTH
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 4


def test_a_destination_serving_shorter_sequences_than_the_request_may_reach_refuses_it(make_engine):
    """A black-box run (2026-12-06): a 10-token prompt with max_tokens 400, moved by an admin Migrate from an
    instance serving 448 tokens to one with a smaller KV cache serving 320, ended there after 310 tokens with
    finish reason length and no error. The state now says how far the request may go on its source, and such a
    destination refuses it; it finishes on its source as never migrated."""
    src, dst = make_engine(), make_engine(max_model_len=40)
    harness, alone = Harness(), Harness()
    sampling = replace(GREEDY, max_tokens=40)  # 11 + 40 = 51 tokens, more than the destination serves
    reference = make_engine()
    reference.add_request("long", PROMPT, sampling)
    expected = alone.finish(reference, "long").token_ids
    src.add_request("long", PROMPT, sampling)
    harness.run_until(src, "long", 3)
    view = src.suspend("long")
    state = src.export_state("long")
    assert state.max_num_tokens == 51
    dst_blocks = dst.reserve_blocks("m-1", view.num_blocks)
    copy_blocks(src, dst, view.block_ids, dst_blocks)
    with pytest.raises(ResourceExhausted, match="may reach 51 tokens .* serves at most 40"):
        dst.import_request("m-1", state)
    assert "long" not in dst._requests
    assert src.resume("long")
    stream = harness.finish(src, "long")
    assert stream.token_ids == expected and stream.finish_reason is FinishReason.LENGTH and len(expected) == 40
    fits = replace(GREEDY, max_tokens=29)  # 11 + 29 = 40: the destination serves it whole
    src.add_request("fits", PROMPT, fits)
    harness.run_until(src, "fits", 3)
    assert dst.free_reservation("m-1")
    view = src.suspend("fits")
    dst_blocks = dst.reserve_blocks("m-2", view.num_blocks)
    copy_blocks(src, dst, view.block_ids, dst_blocks)
    dst.import_request("m-2", src.export_state("fits"))
    src.release("fits")
    assert len(harness.finish(dst, "fits").token_ids) == 29


def test_a_slot_reserved_for_a_migration_in_is_not_given_to_a_local_request(make_engine):
    src, dst = make_engine(), make_engine(max_num_seqs=2)
    harness = Harness()
    src.add_request("moving", PROMPT, GREEDY)
    harness.run_until(src, "moving", 2)
    dst.add_request("local-1", PROMPT[:5], GREEDY)
    harness.step(dst)
    view = src.suspend("moving")
    assert dst.load().num_free_slots == 1
    dst_blocks = dst.reserve_blocks("m-1", view.num_blocks)
    assert dst.load().num_free_slots == 0  # the manager sends no second migration here
    dst.add_request("local-2", PROMPT[:6], GREEDY)
    harness.step(dst)
    assert [r.request_id for r in dst.scheduler.running] == ["local-1"]  # local-2 waits for a slot
    copy_blocks(src, dst, view.block_ids, dst_blocks)
    dst.import_request("m-1", src.export_state("moving"))
    src.release("moving")
    harness.step(dst)
    assert len(dst.scheduler.running) == 2 and [r.request_id for r in dst.scheduler.waiting] == ["local-2"]


async def test_the_engine_thread_sleeps_while_nothing_it_holds_can_run(make_engine):
    """Every block reserved for a migration in and a request waiting: steps schedule nothing. Before,
    the engine thread stepped back to back (tens of thousands of empty steps a second, a core burnt
    beside the event loop that must finish the migration) and empty steps filled the step-time window."""
    import asyncio

    from services.instance.runner import EngineRunner

    engine = make_engine(num_blocks=8)
    runner = EngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        await runner.call(lambda: engine.reserve_blocks("m-in", 8))
        stream = await runner.add("waiting", PROMPT[:6], GREEDY)
        num_steps_before = runner.num_steps
        await asyncio.sleep(0.5)
        assert runner.num_steps == num_steps_before
        await runner.call(lambda: engine.free_reservation("m-in"))  # the command wakes it: the request runs
        first = await asyncio.wait_for(stream.outputs.get(), 10)
        assert first.new_token_ids
    finally:
        runner.stop()
