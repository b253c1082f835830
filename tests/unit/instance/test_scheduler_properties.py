"""Random operations on the scheduler, its block manager (prefix cache on or off) and reservations for
requests migrating in: suspends and resumes, aborts, preemptions, prompt-logprobs prefills, chunk sizes
and budgets of every kind. After every step each block's reference count equals its holders (no leak,
no double free); once the operations stop every request finishes (no request that can never be
scheduled) and every block is free again."""

import collections
import itertools
import random
from dataclasses import dataclass

import pytest

from services.instance.engine.block_manager import BlockManager
from services.instance.engine.request import FinishReason, Request, RequestId, RequestStatus, SamplingParams
from services.instance.engine.reservations import MigrationId, Reservations
from services.instance.engine.scheduler import Scheduler
from services.instance.engine.text_output import TextOutput
from tests.unit.instance.test_scheduler import _NoText

pytestmark = pytest.mark.timeout(60)

MAX_STEPS = 3000  # every scenario drains in far fewer steps
NUM_OPERATION_STEPS = 40  # random suspends, aborts and reservations happen only before this step
_arrivals = itertools.count()


@dataclass(frozen=True)
class Setup:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_tokens: int
    enable_prefix_caching: bool
    max_prompt_logit_rows: int
    recomputes_one_by_one: bool

    @classmethod
    def draw(cls, rng: random.Random) -> "Setup":
        max_num_seqs, budget = rng.randint(1, 5), rng.randint(1, 40)
        chunk = rng.randint(1, budget - max_num_seqs) if budget > max_num_seqs and rng.random() < 0.3 else 0
        return cls(block_size=rng.choice([1, 2, 4]), num_blocks=rng.randint(3, 24), max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=budget, prefill_chunk_tokens=chunk,
                   enable_prefix_caching=rng.random() < 0.6, max_prompt_logit_rows=rng.choice([1, 3, 512]),
                   recomputes_one_by_one=rng.random() < 0.7)


class World:
    """A scheduler and what holds blocks beside its requests: reservations for migrations in."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.block_manager = BlockManager(setup.num_blocks, setup.block_size, setup.enable_prefix_caching)
        self.reservations = Reservations(self.block_manager)
        self.scheduler = Scheduler(self.block_manager, setup.max_num_seqs, setup.max_num_batched_tokens,
                                   max_prompt_logit_rows=setup.max_prompt_logit_rows,
                                   num_reserved_slots=lambda: len(self.reservations),
                                   recomputes_one_by_one=setup.recomputes_one_by_one,
                                   prefill_chunk_tokens=setup.prefill_chunk_tokens)
        self.migration_ids: list[MigrationId] = []

    def step(self, rng: random.Random) -> None:
        for s in self.scheduler.schedule().scheduled:
            request = s.request
            assert s.is_sampled == (request.num_computed_tokens == request.num_tokens)
            if not s.is_sampled:
                continue
            request.output_token_ids.append(rng.randint(1, 50))
            if request.num_output_tokens >= request.sampling.max_tokens:
                self.scheduler.remove(request, FinishReason.LENGTH)

    def check_blocks(self) -> None:
        holders = collections.Counter()
        for request in self.scheduler.running + self.scheduler.suspended:
            holders.update(request.block_table)
            assert len(request.block_table) * self.setup.block_size >= request.num_computed_tokens
        for block_ids in self.reservations._blocks.values():
            holders.update(block_ids)
        for block_id in range(self.setup.num_blocks):
            assert self.block_manager.ref_count(block_id) == holders[block_id], f"block {block_id}"
        assert self.block_manager.num_free_blocks == self.setup.num_blocks - len(holders)
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in self.scheduler.waiting)
        assert all(r.status is RequestStatus.RUNNING for r in self.scheduler.running)
        num_slots_held = len(self.scheduler.running) + sum(bool(r.block_table) for r in self.scheduler.suspended)
        assert num_slots_held <= self.setup.max_num_seqs

    def random_operation(self, rng: random.Random) -> None:
        scheduler, roll = self.scheduler, rng.random()
        if roll < 0.1 and scheduler.num_busy_slots + len(self.reservations) < self.setup.max_num_seqs:
            self._reserve(rng)
        elif roll < 0.2 and self.migration_ids:
            self.reservations.free(self.migration_ids.pop(rng.randrange(len(self.migration_ids))))
        elif roll < 0.25 and (scheduler.running or scheduler.waiting):
            self._suspend(rng.choice(scheduler.running + scheduler.waiting))
        elif roll < 0.35 and scheduler.suspended:
            scheduler.resume(rng.choice(scheduler.suspended))
        elif roll < 0.38 and (scheduler.running or scheduler.waiting or scheduler.suspended):
            scheduler.remove(rng.choice(scheduler.running + scheduler.waiting + scheduler.suspended), FinishReason.ABORT)

    def end_operations(self) -> None:
        while self.migration_ids:
            self.reservations.free(self.migration_ids.pop())
        for request in list(self.scheduler.suspended):
            self.scheduler.resume(request)

    def _reserve(self, rng: random.Random) -> None:
        migration_id = MigrationId(f"m{len(self.migration_ids)}-{rng.random()}")
        try:
            self.reservations.reserve(migration_id, rng.randint(0, 3))
        except Exception:  # noqa: BLE001 -- ResourceExhausted: the reservation holds nothing
            return
        self.migration_ids.append(migration_id)

    def _suspend(self, request: Request) -> None:
        """Only as the engine allows: waiting, or decoding."""
        is_decoding = request.num_uncomputed_tokens <= 1 and request.output_token_ids
        if request.status is RequestStatus.WAITING or is_decoding:
            self.scheduler.suspend(request)


def random_requests(rng: random.Random, setup: Setup) -> list[tuple[int, Request]]:
    """(arrival step, request): prompts up to the whole cache, some sharing a prefix, some wanting prompt logprobs."""
    shared_prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    requests = []
    for i in range(rng.randint(1, 8)):
        num_prompt_tokens = rng.randint(1, setup.num_blocks * setup.block_size)
        tokens = (shared_prefix if rng.random() < 0.5 else []) + [rng.randint(1, 50) for _ in range(num_prompt_tokens)]
        sampling = SamplingParams(max_tokens=rng.randint(1, 12),
                                  prompt_logprobs=1 if rng.random() < 0.3 else None)
        request = Request(RequestId(f"r{i}"), tuple(tokens[:num_prompt_tokens]), sampling, seed=0,
                          arrival_order=next(_arrivals), text=TextOutput(_NoText(), ()), priority=rng.choice([0, 1]))
        requests.append((rng.randint(0, 30), request))
    return requests


@pytest.mark.parametrize("seed", range(0, 400, 40))
def test_random_operations_keep_block_counts_and_every_request_finishes(seed):
    for scenario in range(seed, seed + 40):
        rng = random.Random(scenario)
        setup = Setup.draw(rng)
        world, requests = World(setup), random_requests(rng, setup)
        for step in range(MAX_STEPS):
            for _, request in (r for r in requests if r[0] == step):
                world.scheduler.add(request)
            if step < NUM_OPERATION_STEPS:
                world.random_operation(rng)
            elif step == NUM_OPERATION_STEPS:
                world.end_operations()
            world.step(rng)
            world.check_blocks()
            if step > NUM_OPERATION_STEPS and not world.scheduler.has_unfinished():
                break
        assert not world.scheduler.has_unfinished(), f"scenario {scenario} ({setup}) never finished"
        assert world.block_manager.num_free_blocks == setup.num_blocks, f"scenario {scenario} leaked blocks"
