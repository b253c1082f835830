"""RequestRunner under seeded random interleavings: instances die and come back (before an Attach, between
a commit and its hand-off being read, mid-resume), requests migrate on (back to instances they left, whose
Abort may still be under way), Aborts land late, and clients leave at any await. A fake cluster keeps the
instances' rules (epochs, Attach refusals, a resume replacing a stream, an Abort that ends what runs under its
id unless that is a newer copy than it names, a source's Abort dropping the copy its unread hand-off left); half
the seeds play instances from before Aborts named their copy, which end whatever runs under the id. Checked for
every seed: nothing lost, nothing repeated, one seed's tokens, and no copy a client attached to is left running
(no sockets). Each mutation tried when this was written fails it: no wait for the Abort before a resume on the
same instance, no calling off an Abort when the request is handed back there (on the older instances: on the
others the Abort naming its copy covers both)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from services.common.errors import Aborted, FailedPrecondition, NotFound, Unavailable
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import CopyRef, FinishReason, Handoff, InstanceId, Target, TokenChunk
from services.frontend.request_runner import RequestRunner
from tests.unit.frontend.factories import FakeMembership, decode, entry, make_spec, make_state

pytestmark = pytest.mark.timeout(60)

NUM_TOKENS = 12
REFERENCE = [100 + i for i in range(NUM_TOKENS)]
NUM_SEEDS = 120
SEEDS_PER_TEST = 20  # one test's seeds in series: 120 took 42-50 s of a 60 s timeout beside a loaded test worker


@dataclass
class Copy:
    """A request on one instance: its next token index, epoch, and the queue its stream reads."""

    next_index: int
    epoch: int
    is_attached: bool
    attempt: int = 0  # the Generate it began with (GenerateSpec.attempt), kept across migrations
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)


class Cluster:
    """`InstanceStreams` over instances that decode, migrate, die and come back at random."""

    def __init__(self, rng: random.Random, ids: list[str], honours_copy_refs: bool = True) -> None:
        self.rng = rng
        self.honours_copy_refs = honours_copy_refs  # False: an Abort ends whatever runs under its id
        self.alive = dict.fromkeys(ids, True)
        self.copies: dict[str, dict[str, Copy]] = {i: {} for i in ids}
        self.handed_off: dict[tuple[str, str], tuple[str, Copy]] = {}  # (source, request) -> where it went
        self.abort_tasks: set[asyncio.Task] = set()

    def kill(self, instance: str) -> None:
        self.alive[instance] = False
        for copy in self.copies[instance].values():
            copy.outputs.put_nowait(Unavailable("killed"))
        self.copies[instance].clear()
        self.handed_off = {k: v for k, v in self.handed_off.items() if k[0] != instance}
        asyncio.get_running_loop().call_later(self.rng.random() * 0.01, self.alive.__setitem__, instance, True)

    async def _decode(self, instance: str, request_id: str, copy: Copy) -> None:
        while self.copies[instance].get(request_id) is copy:
            await asyncio.sleep(self.rng.random() * 0.003)
            if self.copies[instance].get(request_id) is not copy:
                return  # aborted, replaced or killed
            if self.rng.random() < 0.05:
                self.kill(instance)
            elif self.rng.random() < 0.12 and copy.is_attached:  # unattached copies never move on
                self._migrate(instance, request_id, copy)
            else:
                index, copy.next_index = copy.next_index, copy.next_index + 1
                finish = FinishReason.LENGTH if copy.next_index == NUM_TOKENS else None
                if finish is not None:
                    del self.copies[instance][request_id]
                copy.outputs.put_nowait(TokenChunk(index, (REFERENCE[index],), decode([REFERENCE[index]]), finish,
                                                   epoch=copy.epoch))

    def _migrate(self, source: str, request_id: str, copy: Copy) -> None:
        destinations = [i for i, up in self.alive.items() if up and i != source and request_id not in self.copies[i]]
        if not destinations:
            return
        destination = self.rng.choice(destinations)
        moved = Copy(copy.next_index, copy.epoch + 1, is_attached=False, attempt=copy.attempt)
        self.copies[destination][request_id] = moved
        del self.copies[source][request_id]
        self.handed_off[(source, request_id)] = (destination, moved)
        asyncio.get_running_loop().create_task(self._decode(destination, request_id, moved))
        handoff = Handoff(InstanceId(destination), f"addr-{destination}", moved.epoch, copy.next_index)
        copy.outputs.put_nowait(TokenChunk(copy.next_index, (), "", None, epoch=copy.epoch, handoff=handoff))

    async def _stream(self, instance: str, request_id: str, copy: Copy, from_index: int):
        is_over = False
        try:
            while not is_over:
                item = await copy.outputs.get()
                if not self.alive[instance]:
                    item = Unavailable("the instance is gone")
                if isinstance(item, Exception):
                    is_over = True
                    raise item
                is_over = item.handoff is not None or item.finish_reason is not None
                if is_over or item.token_index >= from_index:
                    yield item
        finally:
            if not is_over and self.copies[instance].get(request_id) is copy:
                del self.copies[instance][request_id]  # its client went away: the instance aborts it

    async def generate(self, target: Target, spec):
        instance, request_id = target.instance_id, spec.request_id
        if not self.alive[instance]:
            raise Unavailable("connection refused")
        assert list(spec.resume_token_ids) == REFERENCE[:len(spec.resume_token_ids)]
        if (old := self.copies[instance].get(request_id)) is not None:  # a resume replaces a copy nobody attached
            if old.is_attached:  # to, and one whose client left without the instance noticing (it was frozen)
                old.outputs.put_nowait(Unavailable("resumed on this instance by a newer attempt"))
            del self.copies[instance][request_id]
        copy = self.copies[instance][request_id] = Copy(len(spec.resume_token_ids), 0, is_attached=True,
                                                        attempt=spec.attempt)
        asyncio.get_running_loop().create_task(self._decode(instance, request_id, copy))
        async for item in self._stream(instance, request_id, copy, 0):
            yield item

    async def attach(self, target: Target, request_id, from_token_index: int, epoch: int):
        instance = target.instance_id
        if not self.alive[instance]:
            raise Unavailable("connection refused")
        if (copy := self.copies[instance].get(request_id)) is None:
            raise NotFound("not on this instance")
        if copy.epoch != epoch:
            raise Aborted(f"at epoch {copy.epoch} here, not {epoch}")
        if copy.is_attached:
            raise FailedPrecondition("already attached")
        copy.is_attached = True
        async for item in self._stream(instance, request_id, copy, from_token_index):
            yield item

    def abort_soon(self, target: Target, request_id, ref: CopyRef | None = None) -> asyncio.Task:
        """Lands a moment later: ends what runs under the id there (its reader gets ABORT) unless it is newer than
        `ref`, or drops the copy an unread hand-off from there left."""
        async def abort() -> None:
            await asyncio.sleep(self.rng.random() * 0.02)
            instance = target.instance_id
            if not self.alive[instance]:
                return
            if (newer := self.copies[instance].get(request_id)) is not None and ref is not None and \
                    self.honours_copy_refs and (ref.attempt, ref.epoch) < (newer.attempt, newer.epoch):
                return
            if (copy := self.copies[instance].pop(request_id, None)) is not None:
                copy.outputs.put_nowait(TokenChunk(copy.next_index, (), "", FinishReason.ABORT, epoch=copy.epoch))
                return
            destination, moved = self.handed_off.pop((instance, request_id), (None, None))
            if destination is not None and self.copies[destination].get(request_id) is moved and not moved.is_attached:
                del self.copies[destination][request_id]
        task = asyncio.get_running_loop().create_task(abort())
        self.abort_tasks.add(task)
        return task


class RandomManager:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    async def dispatch(self, spec, exclude):
        alive = [i for i, up in self._cluster.alive.items() if up]
        choices = [i for i in alive if i not in exclude] or alive
        return Target(InstanceId(self._cluster.rng.choice(choices)), "addr") if choices else None


async def run_seed(seed: int) -> None:
    rng = random.Random(seed)
    ids = ["a", "b"] if seed % 2 else ["a", "b", "c"]
    cluster = Cluster(rng, ids, honours_copy_refs=seed // 2 % 2 == 0)
    dispatcher = Dispatcher(RandomManager(cluster), FakeMembership(*map(entry, ids)), cooldown_s=0.0)
    runner = RequestRunner(dispatcher, cluster, max_resumes=10, resume_backoff_s=0.0005,
                           lone_resume_backoff_s=0.002, no_instance_wait_s=0.05)
    state = make_state()
    task = asyncio.create_task(runner.run(state, make_spec(max_tokens=NUM_TOKENS)))

    async def kill_now_and_then() -> None:
        while True:
            await asyncio.sleep(rng.random() * 0.02)
            if cluster.alive[instance := rng.choice(ids)]:
                cluster.kill(instance)
    killer = asyncio.create_task(kill_now_and_then())
    client_leaves = seed % 3 == 0
    if client_leaves:
        await asyncio.sleep(rng.random() * 0.03)
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    killer.cancel()
    await asyncio.gather(*cluster.abort_tasks, return_exceptions=True)  # (called-off ones end cancelled)

    assert state.token_ids == REFERENCE[:state.num_output_tokens], seed  # nothing lost, nothing repeated
    assert state.text == decode(state.token_ids), seed
    if not client_leaves:
        if state.error is not None:
            assert "--max-resumes" in state.error.message, (seed, state.error)
        else:
            assert state.token_ids == REFERENCE and state.finish_reason is FinishReason.LENGTH, seed
    running = {i: [r for r, c in copies.items() if c.is_attached] for i, copies in cluster.copies.items()}
    assert not any(running.values()), (seed, running)  # no attached copy decodes for a client that left


@pytest.mark.parametrize("first_seed", range(0, NUM_SEEDS, SEEDS_PER_TEST))
async def test_random_deaths_handoffs_late_aborts_and_clients_leaving_lose_and_repeat_nothing(first_seed):
    for seed in range(first_seed, first_seed + SEEDS_PER_TEST):
        await run_seed(seed)
