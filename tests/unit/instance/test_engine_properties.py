"""Seeded random operation sequences against two real engines on a tiny random-weight model. Requests arrive
(greedy, seeded and constrained; n > 1 siblings of one prompt; cache salts, priorities, stop token ids and stop
strings, min_tokens, prompt logprobs; max_tokens, the context window or the whole cache ends them), and between
steps any of them may be aborted, suspended and resumed, parked for a PD hand-off and resumed, migrated to the
other engine (a multi-stage copy while it decodes, the destination's cached blocks checked by checksum, a commit
that fails now and then) or resumed there as after its engine died, while reservations for migrations in take
blocks away. After every operation each block's reference count equals its holders (no leak, no double free)
and every request is in the queue its status says; at the end every request has finished (none lost or stuck),
every block is free, and each request that was not aborted got the tokens, text and finish reason it gets alone
in an engine of the same config."""

from __future__ import annotations

import collections
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import llguidance
import pytest

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.step_output import StepOutput
from services.instance.engine.migration_state import is_movable, is_prefill_done
from services.instance.engine.request import FinishReason, RequestStatus, SamplingParams
from tests.unit.instance.test_engine import gqa, make_engine  # noqa: F401 (fixtures)
from tests.unit.instance.test_migration_engine import copy_blocks

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
MAX_STEPS = 2000  # every scenario drains in far fewer
NUM_OPERATION_STEPS = 50  # random operations happen only before this step
GRAMMAR = llguidance.LLMatcher.grammar_from_regex("[a-z ]{100}")


@pytest.fixture
def new_engine(gqa, make_engine) -> Callable[[EngineConfig], LLMEngine]:  # noqa: F811
    def new(config: EngineConfig) -> LLMEngine:
        return make_engine(gqa, num_blocks=config.num_blocks, block_size=config.block_size,
                           max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                           max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
                           prefill_chunk_tokens=config.prefill_chunk_tokens)
    return new


@dataclass(frozen=True)
class Spec:
    """A request as its client sends it."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    priority: int


@dataclass
class Stream:
    """What the request's client received, across engines."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    first_start: int | None = None  # where the first engine to compute the prompt computed it from

    def add(self, output: StepOutput) -> None:
        assert self.finish_reason is None, f"{output.request_id}: an output after its finish"
        assert output.token_index == len(self.token_ids), f"{output.request_id}: gap or duplicate token index"
        self.first_start = self.first_start if self.first_start is not None else output.first_start
        self.token_ids += output.new_token_ids
        self.text += output.text
        self.finish_reason = output.finish_reason


@dataclass
class Migration:
    """A live migration between its first stage (blocks reserved, full ones copied) and its commit."""

    migration_id: str
    request_id: str
    src: int
    dst: int
    num_preemptions: int  # the source request's, when the copies were made: a preemption voids them
    copied: dict[int, int]  # block index -> source block id copied there


def draw_config(rng: random.Random) -> EngineConfig:
    num_blocks = rng.randint(8, 24)
    max_num_seqs = rng.randint(1, 5)
    budget = rng.randint(max_num_seqs + BLOCK_SIZE, 48)
    chunk = rng.choice([0, 0, BLOCK_SIZE, rng.randint(1, budget - max_num_seqs)])
    max_model_len = num_blocks * BLOCK_SIZE * rng.choice([1, 1, 2])  # longer: a request may outgrow the cache
    return EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=BLOCK_SIZE,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        enable_prefix_caching=rng.random() < 0.8, prefill_chunk_tokens=chunk)


def draw_specs(rng: random.Random, config: EngineConfig) -> list[tuple[int, Spec]]:
    """(arrival step, request); some share a prompt (n > 1 choices) or a prefix, some a cache salt."""
    shared = [rng.randrange(1, 300) for _ in range(3 * BLOCK_SIZE)]
    specs = []
    for i in range(rng.randint(2, 8)):
        num_prompt = rng.randint(1, config.num_blocks * BLOCK_SIZE - 2)
        if i and rng.random() < 0.25:  # a sibling of the previous request: the same prompt
            prompt = specs[-1][1].prompt
        else:
            head = shared[:rng.randint(0, len(shared))] if rng.random() < 0.5 else []
            prompt = tuple((head + [rng.randrange(1, 300) for _ in range(num_prompt)])[:num_prompt])
        greedy = rng.random() < 0.5
        max_tokens = rng.randint(1, 40)
        sampling = SamplingParams(temperature=0.0 if greedy else 0.8, seed=None if greedy else rng.randrange(1000),
                                  max_tokens=max_tokens, ignore_eos=rng.random() < 0.8,
                                  min_tokens=rng.choice([0, 0, 0, rng.randint(0, max_tokens)]),
                                  cache_salt=rng.choice(["", "", "tenant-a"]), logprobs=rng.choice([0, 0, 2]),
                                  prompt_logprobs=rng.choice([None, None, None, 1]),
                                  grammar=GRAMMAR if rng.random() < 0.1 else "")
        specs.append((rng.randint(0, 40), Spec(f"r{i}", prompt, sampling, rng.choice([0, 0, 1]))))
    return specs


class World:
    """Two engines, the requests' client streams, the migrations and reservations under way."""

    def __init__(self, engines: list[LLMEngine], rng: random.Random) -> None:
        self.engines = engines
        self.rng = rng
        self.streams: dict[str, Stream] = {}
        self.specs: dict[str, Spec] = {}
        self.where: dict[str, int] = {}  # request id -> the engine it runs on
        self.aborted: set[str] = set()
        self.migrations: dict[str, Migration] = {}  # by request id
        self.suspended: set[str] = set()  # suspended or held by us, to be resumed
        self.pressure: list[tuple[int, str]] = []  # (engine, migration id) of reservations nobody commits

    # Requests in and out.

    def add(self, spec: Spec) -> None:
        engine = self.rng.randrange(len(self.engines))
        self.engines[engine].add_request(spec.request_id, spec.prompt, spec.sampling, priority=spec.priority)
        self.streams[spec.request_id] = Stream()
        self.specs[spec.request_id] = spec
        self.where[spec.request_id] = engine

    def step(self) -> None:
        for i, engine in enumerate(self.engines):
            for output in engine.step():
                self._deliver(i, output)

    def _deliver(self, engine: int, output: StepOutput) -> None:
        assert self.where.get(output.request_id) == engine, f"{output.request_id}: an output from the wrong engine"
        self.streams[output.request_id].add(output)
        if output.finish_reason is not None:
            del self.where[output.request_id]
            self._forget_migration(output.request_id)
            self.suspended.discard(output.request_id)

    def abort(self, request_id: str) -> None:
        output = self.engines[self.where[request_id]].abort_with_output(request_id)
        assert output is not None and output.finish_reason is FinishReason.ABORT
        self._deliver(self.where[request_id], output)
        self.aborted.add(request_id)

    # Operations between steps.

    def random_operation(self) -> None:
        rng, roll = self.rng, self.rng.random()
        live = sorted(self.where)
        if roll < 0.06 and live:
            self.abort(rng.choice(live))
        elif roll < 0.25 and live:
            self._start_migration(rng.choice(live))
        elif roll < 0.45 and self.migrations:
            self._finish_migration(self.migrations[rng.choice(sorted(self.migrations))], fails=rng.random() < 0.2)
        elif roll < 0.52 and live:
            self._suspend(rng.choice(live))
        elif roll < 0.62 and self.suspended:
            request_id = rng.choice(sorted(self.suspended))
            self.suspended.discard(request_id)
            assert self.engines[self.where[request_id]].resume(request_id)
        elif roll < 0.68:
            self._reserve_pressure()
        elif roll < 0.74 and self.pressure:
            engine, migration_id = self.pressure.pop(rng.randrange(len(self.pressure)))
            assert self.engines[engine].free_reservation(migration_id)
        elif roll < 0.8 and live:
            self._resume_elsewhere(rng.choice(live))

    def end_operations(self) -> None:
        for migration in list(self.migrations.values()):
            self._finish_migration(migration, fails=False)
        for request_id in sorted(self.suspended):
            assert self.engines[self.where[request_id]].resume(request_id)
        self.suspended.clear()
        for engine, migration_id in self.pressure:
            assert self.engines[engine].free_reservation(migration_id)
        self.pressure.clear()

    def _suspend(self, request_id: str) -> None:
        """As a migration or a PD hand-off would: suspend a movable request, or park a decoding one."""
        if request_id in self.migrations or request_id in self.suspended:
            return
        engine = self.engines[self.where[request_id]]
        request = engine._requests[request_id]
        if self.rng.random() < 0.5:
            if engine.hold(request_id):
                self.suspended.add(request_id)
            else:
                assert not is_prefill_done(request)
        elif is_movable(request):
            engine.suspend(request_id)
            self.suspended.add(request_id)

    def _resume_elsewhere(self, request_id: str) -> None:
        """Its engine died: the client resumes it on the other one with the tokens and text it has."""
        if request_id in self.migrations or request_id in self.suspended:
            return
        spec, stream, engine = self.specs[request_id], self.streams[request_id], self.where[request_id]
        assert self.engines[engine].abort(request_id)
        self.engines[1 - engine].add_request(request_id, spec.prompt, spec.sampling, priority=spec.priority,
                                             resume_token_ids=stream.token_ids, resume_text=stream.text,
                                             first_start=stream.first_start)
        self.where[request_id] = 1 - engine

    def _reserve_pressure(self) -> None:
        engine = self.rng.randrange(len(self.engines))
        migration_id = f"pressure-{uuid.uuid4().hex[:6]}"
        try:
            self.engines[engine].reserve_blocks(migration_id, self.rng.randint(1, 4))
        except ResourceExhausted:
            return
        self.pressure.append((engine, migration_id))

    # Live migration, as migration.py and migration_in.py run it, with the blocks copied in place.

    def _start_migration(self, request_id: str) -> None:
        src_index = self.where[request_id]
        src, dst_index = self.engines[src_index], 1 - self.where[request_id]
        dst = self.engines[dst_index]
        if request_id in self.migrations or request_id in self.suspended:
            return
        if not is_movable(src._requests[request_id]):
            with pytest.raises(FailedPrecondition):
                src.suspend(request_id)
            return
        view = src.migration_blocks(request_id)
        migration_id = f"m-{uuid.uuid4().hex[:6]}"
        try:
            dst.reserve_blocks(migration_id, view.num_blocks, view.block_hashes)
        except ResourceExhausted:
            return
        try:
            reserved = keep_cached_with_our_bits(src, dst, migration_id, view)
        except ResourceExhausted:
            assert dst.free_reservation(migration_id)
            return
        num_cached = dst.num_cached_reserved(migration_id)
        copied = {i: view.block_ids[i] for i in range(num_cached, view.num_full_blocks)}
        copy_blocks(src, dst, list(copied.values()), [reserved[i] for i in copied])
        self.migrations[request_id] = Migration(migration_id, request_id, src_index, dst_index,
                                                view.num_preemptions, copied)

    def _finish_migration(self, m: Migration, fails: bool) -> None:
        """The last stage: suspend, copy what is left, commit (or fail: the request stays on its source)."""
        del self.migrations[m.request_id]
        src, dst = self.engines[m.src], self.engines[m.dst]
        try:
            view = src.suspend(m.request_id)
            if view.num_preemptions != m.num_preemptions:  # recomputed since the check: maybe other bits now
                keep_cached_with_our_bits(src, dst, m.migration_id, view)
            reserved = dst.reserve_blocks(m.migration_id, view.num_blocks)
        except (FailedPrecondition, ResourceExhausted):
            dst.free_reservation(m.migration_id)
            src.resume(m.request_id)
            return
        num_cached = dst.num_cached_reserved(m.migration_id)
        valid = m.copied if view.num_preemptions == m.num_preemptions else {}
        pending = [i for i in range(num_cached, view.num_blocks) if valid.get(i) != view.block_ids[i]]
        copy_blocks(src, dst, [view.block_ids[i] for i in pending], [reserved[i] for i in pending])
        if fails:
            assert dst.free_reservation(m.migration_id)
            assert src.resume(m.request_id)
            return
        dst.import_request(m.migration_id, src.export_state(m.request_id))
        src.release(m.request_id)
        self.where[m.request_id] = m.dst

    def _forget_migration(self, request_id: str) -> None:
        """The request finished or was aborted: its migration gives its reservation back."""
        m = self.migrations.pop(request_id, None)
        if m is not None:
            assert self.engines[m.dst].free_reservation(m.migration_id)

    # Invariants.

    def check(self) -> None:
        for i, engine in enumerate(self.engines):
            check_engine(engine, {r for r, e in self.where.items() if e == i})

    def check_drained(self) -> None:
        for engine in self.engines:
            assert not engine._requests and not engine.has_unfinished() and not engine.scheduler.suspended
            assert len(engine.reservations) == 0
            assert engine.block_manager.num_free_blocks == engine.config.num_blocks, "blocks leaked"
        unfinished = [r for r, s in self.streams.items() if s.finish_reason is None]
        assert not unfinished, f"requests never finished: {unfinished}"


def keep_cached_with_our_bits(src: LLMEngine, dst: LLMEngine, migration_id: str, view) -> tuple[int, ...]:
    """migration.py's check: the destination keeps only its leading cached blocks with our bits."""
    reserved = dst.reservations.blocks(migration_id)
    num_cached = dst.num_cached_reserved(migration_id)
    if not num_cached:
        return reserved
    own = src.block_checksums(view.block_ids[:min(num_cached, view.num_full_blocks)])
    theirs = dst.block_checksums(reserved[:num_cached])
    num_kept = next((i for i in range(len(own)) if own[i] != theirs[i]), len(own))
    return reserved if num_kept == num_cached else dst.keep_cached_reserved(migration_id, num_kept)


def check_engine(engine: LLMEngine, request_ids: set[str]) -> None:
    """Reference counts equal holders, free counts add up, each request is where its status says."""
    scheduler, block_manager = engine.scheduler, engine.block_manager
    assert set(engine._requests) == request_ids
    queues = {RequestStatus.WAITING: scheduler.waiting, RequestStatus.RUNNING: scheduler.running,
              RequestStatus.SUSPENDED: scheduler.suspended}
    for request in engine._requests.values():
        assert sum(request in q for q in queues.values()) == 1 and request in queues[request.status]
    assert sum(len(q) for q in queues.values()) == len(request_ids)
    holders = collections.Counter()
    for request in (*scheduler.running, *scheduler.suspended):
        holders.update(request.block_table)
        assert len(request.block_table) * block_manager.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not request.block_table and request.num_computed_tokens == 0
    for blocks in engine.reservations._blocks.values():
        holders.update(blocks)
    for block_id in range(block_manager.num_blocks):
        assert block_manager.ref_count(block_id) == holders[block_id], f"block {block_id}"
    assert block_manager.num_free_blocks == block_manager.num_blocks - len(holders)
    assert scheduler.num_busy_slots <= engine.config.max_num_seqs


def reference(new_engine, config: EngineConfig, spec: Spec) -> Stream:
    """The request alone, in an engine of the same config without a prefix cache."""
    engine = new_engine(replace(config, enable_prefix_caching=False))
    engine.add_request(spec.request_id, spec.prompt, spec.sampling)
    stream = Stream()
    while stream.finish_reason is None:
        for output in engine.step():
            stream.add(output)
    return stream


def with_stops(rng: random.Random, new_engine, config: EngineConfig, spec: Spec) -> tuple[Spec, Stream]:
    """Maybe a stop token id or a stop string taken from what the request generates alone."""
    alone = reference(new_engine, config, spec)
    roll = rng.random()
    if roll < 0.2 and len(alone.token_ids) > 1:
        spec = replace(spec, sampling=replace(spec.sampling, stop_token_ids=(rng.choice(alone.token_ids[1:]),)))
    elif roll < 0.4 and len(alone.text) > 3:
        start = rng.randrange(1, len(alone.text) - 2)
        spec = replace(spec, sampling=replace(spec.sampling, stop=(alone.text[start:start + 2],)))
    else:
        return spec, alone
    return spec, reference(new_engine, config, spec)


def run_scenario(new_engine, scenario: int) -> None:
    rng = random.Random(scenario)
    config = draw_config(rng)
    arrivals = [(step, *with_stops(rng, new_engine, config, spec)) for step, spec in draw_specs(rng, config)]
    world = World([new_engine(config), new_engine(config)], rng)
    for step in range(MAX_STEPS):
        for _, spec, _ in (a for a in arrivals if a[0] == step):
            world.add(spec)
            world.check()
        if step < NUM_OPERATION_STEPS:
            for _ in range(rng.randint(0, 3)):
                world.random_operation()
                world.check()
        elif step == NUM_OPERATION_STEPS:
            world.end_operations()
        world.step()
        world.check()
        if step > NUM_OPERATION_STEPS and not world.where:
            break
    world.check_drained()
    for _, spec, expected in arrivals:
        if spec.request_id in world.aborted:
            continue
        got = world.streams[spec.request_id]
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                                expected.finish_reason), \
            f"scenario {scenario} ({config}): {spec.request_id} differs from its run alone"


# make test runs the first 20 scenarios; `-m slow` the other 40
@pytest.mark.parametrize("first", [0, 10, *(pytest.param(first, marks=pytest.mark.slow) for first in range(20, 60, 10))])
def test_random_operations_keep_blocks_accounted_and_outputs_as_alone(new_engine, first):
    for scenario in range(first, first + 10):
        run_scenario(new_engine, scenario)
