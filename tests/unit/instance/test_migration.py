"""The migration driver (source) and inbox (destination) without sockets: two engine runners in
one process, the destination reached through its MigrationInbox, blocks copied tensor to tensor.
Failures are injected at each step; the request must always end correctly on one side and no
block may stay held anywhere."""

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
import types
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.pick_announcement import REFUSED_BY_DESTINATION, REFUSED_BY_TRANSFER, is_source_busy, refused_by
from services.common.prefix_hash import next_block_hash
from services.common.errors import (Aborted, ErrorInterceptor, FailedPrecondition, FerryError, InvalidArgument,
                                    NotFound, ResourceExhausted, Unavailable)
from services.instance.engine.block_manager import num_blocks_out_of_window
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.step_output import StepOutput
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.migration_state import RequestState
from services.instance.engine.model import load_model
from services.instance.engine.request import FinishReason, RequestOrigin, SamplingParams
from services.instance.engine.tokenizer import Tokenizer
from services.instance.config import InstanceRole, PdHandoff
from services.instance.convert import migrate_out_plan_from_proto
from services.instance.handoff import Handoff
from services.instance.migration import MigrationDriver
from services.instance.migration_domain import MigrateOutPlan, MigrationSettings, RefusedByDestination, Reservation
from services.instance.migration_in import MigrationInbox, TransferEndpoint
from services.instance.migration_slots import MigrationSlots
from services.instance.pd_handoff import DecodeHandoff, DecodePlace
from services.instance.runner import EngineRunner, RequestStream
from services.instance.server import InstanceIdentity, InstanceServicer
from services.transfer.domain import BlockTransfer, TransferBackend, TransferResult
from tests.loop_errors import collect_dropped_tasks, unretrieved_errors

pytestmark = pytest.mark.timeout(120)  # 60 s: the live cached-blocks test took 18 s of it at load 20
torch.set_num_threads(1)

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 8, 64, 2, 11, 19, 23, 29, 37, 41, 43, 47, 53]
# Tests move their request after reading 30 tokens or fewer: 90 left then, many more than the steps a move takes
# here. 400 made each test decode 370 tokens after its move (7-20 s a test at load 8). A test that waits while its
# request must decode on (0.2 s, longer than 90 steps on a quiet machine) paces that engine meanwhile (`paced`).
SAMPLING = SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=120, ignore_eos=True)
PACE_S = 0.05  # a paced engine's steps take this long at least: 90 steps 4.5 s
NUM_BLOCKS = 160
BLOCK_SIZE = 4
LONG_STEP_MAX_S = 30.0  # a `long_step` the test never ends (it failed first) ends by itself after this


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@dataclass
class Side:
    name: str
    engine: LLMEngine
    runner: EngineRunner
    slots: MigrationSlots
    inbox: MigrationInbox


class FaultyPeer:
    """The destination as the source sees it, with a fault to inject per call name."""

    def __init__(self, dst: Side) -> None:
        self.dst = dst
        self.faults: dict[str, FerryError] = {}
        self.calls: list[str] = []
        self.prepare_timeouts: list[float | None] = []
        self.prepare_on_purpose: list[bool] = []  # each call's can_decode_on_prefill

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if name in self.faults:
            raise self.faults[name]

    async def prepare_migrate_in(self, migration_id, request_id, src_instance_id, num_blocks,
                                 grow_only=False, block_hashes=(), timeout_s=None, keep_cached_blocks=None,
                                 max_num_tokens=0, can_decode_on_prefill=False,
                                 num_leading_blocks_not_held=0) -> Reservation:
        self.prepare_timeouts.append(timeout_s)
        self.prepare_on_purpose.append(can_decode_on_prefill)
        self._check("prepare")
        return await self.dst.inbox.prepare(migration_id, request_id, src_instance_id, num_blocks, grow_only=grow_only,
                                            block_hashes=block_hashes, keep_cached_blocks=keep_cached_blocks,
                                            num_leading_blocks_not_held=num_leading_blocks_not_held)

    async def commit_migrate_in(self, migration_id: str, state: RequestState, attempt: int = 0) -> None:
        self._check("commit")
        await self.dst.inbox.commit(migration_id, state, attempt=attempt)

    async def abort_migrate_in(self, migration_id: str) -> bool:
        self.calls.append("abort_migrate_in")
        return await self.dst.inbox.abort(migration_id)


@dataclass
class TensorCopier:
    """The transfer service: a tensor copy between the two KV caches (optionally failing on stage n)."""

    src: Side
    dst: Side
    fail_on: int | None = None
    pause: asyncio.Event | None = None  # copies wait for it
    num_calls: int = 0
    transfers: list[BlockTransfer] = field(default_factory=list)
    decode_after_first: str | None = None  # this request decodes a token more before the first copy returns

    async def transfer(self, transfer: BlockTransfer, timeout_s: float, request_id=None) -> TransferResult:
        self.num_calls += 1
        self.transfers.append(transfer)
        if self.pause is not None:
            await self.pause.wait()
        if self.decode_after_first is not None and self.num_calls == 1:
            await self._decode_one_more(self.decode_after_first)
        if self.num_calls == self.fail_on:
            raise Unavailable("transfer service at 127.0.0.1:1 is gone")
        src, dst = self.src.engine.kv_cache.tensor, self.dst.engine.kv_cache.tensor
        dst[:, :, list(transfer.dst_block_ids)] = src[:, :, list(transfer.src_block_ids)]
        num_bytes = self.src.engine.kv_cache.geometry.bytes_per_block * transfer.num_blocks
        return TransferResult(transfer.num_blocks, num_bytes, 0.1, transfer.backend)

    async def _decode_one_more(self, request_id: str) -> None:
        """So the stage after this one has a block to copy (the request's K/V grew past what this one took)."""
        def num_computed() -> int:
            return self.src.engine.migration_blocks(request_id).num_computed_tokens
        start = await self.src.runner.call(num_computed)
        async with asyncio.timeout(10):
            while await self.src.runner.call(num_computed) == start:
                await asyncio.sleep(0.005)


@contextlib.contextmanager
def paced(*sides: Side) -> Iterator[None]:
    """Inside: each step of the sides' engines takes PACE_S at least (the engine thread sleeps first), so their
    requests decode on through a wait of the test's own however fast or busy the machine."""
    def pace(step: Callable[[], list[StepOutput]]) -> Callable[[], list[StepOutput]]:
        def paced_step() -> list[StepOutput]:
            time.sleep(PACE_S)
            return step()
        return paced_step
    for side in sides:
        side.engine.step = pace(side.engine.step)
    try:
        yield
    finally:
        for side in sides:
            del side.engine.step  # the class's again


WINDOW = 8  # windowed_pair's


@pytest.fixture(scope="module")
def tiny_windowed(tiny_model_dir):
    """The tiny model with a sliding window of WINDOW tokens on every layer: the blocks behind it go back."""
    model = load_model(tiny_model_dir)
    model.config = dataclasses.replace(model.config, layer_windows=(WINDOW,) * model.config.num_hidden_layers)
    return model, Tokenizer.from_dir(tiny_model_dir)


@contextlib.contextmanager
def long_step(side: Side) -> Iterator[threading.Event]:
    """Inside: `side`'s engine thread is in a step that lasts until the test sets the event yielded (or the block
    ends), so what the test queues on that thread meanwhile waits behind it however slow or busy the machine. (A
    step of a fixed 0.3-0.5 s let a loaded machine run the queued call before the test's next move.)"""
    ends = threading.Event()
    side.runner.call_soon(lambda: ends.wait(LONG_STEP_MAX_S))
    try:
        yield ends
    finally:
        ends.set()


@pytest.fixture
async def pair(tiny):
    async with sides_of(tiny) as sides:
        yield sides


@pytest.fixture
async def windowed_pair(tiny_windowed):
    async with sides_of(tiny_windowed) as sides:
        yield sides


@contextlib.asynccontextmanager
async def sides_of(tiny) -> AsyncIterator[tuple[Side, Side]]:
    caches, sides = [], {}
    loop = asyncio.get_running_loop()
    for name in ("a", "b"):
        model, tokenizer = tiny
        c = model.config
        geometry = KvGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BLOCK_SIZE, NUM_BLOCKS,
                              torch.float32)
        cache = KvCache.create(f"ferry-kv-test-drv-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry)
        caches.append(cache)
        engine = LLMEngine(model, tokenizer, cache, EngineConfig(num_blocks=NUM_BLOCKS, max_model_len=1024,
                                                                 block_size=BLOCK_SIZE, max_num_seqs=4))
        runner = EngineRunner(engine, loop)
        runner.start()
        slots = MigrationSlots(1)
        inbox = MigrationInbox(runner, slots, timeout_s=5.0, transfer=TransferEndpoint("127.0.0.1:1", f"t{name}"))
        sides[name] = Side(name, engine, runner, slots, inbox)
    try:
        yield sides["a"], sides["b"]
    finally:
        for side in sides.values():
            side.runner.stop()
        for cache in caches:
            cache.close()
            cache.unlink()


def driver(src: Side, peer, copier, max_stages: int = 3, reservation_timeout_s: float = 5.0,
           backend: TransferBackend | None = TransferBackend.GRPC, transfer_id: str = "",
           offered: tuple[TransferBackend, ...] = (), transfer_timeout_s: float = 1.0,
           rpc_timeout_s: float = 1.0) -> MigrationDriver:
    settings = MigrationSettings(instance_id=src.name, transfer_backend=backend, stage_blocks=2,
                                 max_stages=max_stages, is_checksum_verified=True, rpc_timeout_s=rpc_timeout_s,
                                 transfer_timeout_s=transfer_timeout_s, reservation_timeout_s=reservation_timeout_s,
                                 transfer_id=transfer_id, offered_backends=offered)
    return MigrationDriver(src.runner, settings, src.slots, lambda address: peer, copier)


def plan(request_id: str = "r", dst: str = "b") -> MigrateOutPlan:
    return MigrateOutPlan(request_id=request_id, dst_instance_id=dst, dst_address="127.0.0.1:2", dst_transfer_address="",
                          backend=None)


async def read(stream: RequestStream, tokens: list[int], until: int | None = None) -> StepOutput | Handoff:
    async for item in stream:
        if isinstance(item, Handoff):
            return item
        assert item.token_index == len(tokens)
        tokens += item.new_token_ids
        if item.finish_reason is not None or (until is not None and len(tokens) >= until):
            return item
    raise AssertionError("stream ended without a finish reason or hand-off")


async def run_alone(side: Side, max_tokens: int = SAMPLING.max_tokens) -> list[int]:
    """PROMPT run to its end on `side`, alone; its blocks stay in `side`'s prefix cache."""
    stream = await side.runner.add("ref", PROMPT, dataclasses.replace(SAMPLING, max_tokens=max_tokens))
    tokens: list[int] = []
    await read(stream, tokens)
    return tokens


_references: dict[int, list[int]] = {}  # by max_tokens, PROMPT's tokens never migrated: the same on every engine


async def reference(side: Side, sampling: SamplingParams = SAMPLING) -> list[int]:
    """PROMPT's tokens run alone, on `side` the first time for this max_tokens (run in every test, they cost a
    third of this module's time). `side` caches PROMPT's blocks as that run would, so a request started after it
    hits them."""
    if sampling.max_tokens not in _references:
        _references[sampling.max_tokens] = await run_alone(side, sampling.max_tokens)
    else:
        await run_alone(side, max_tokens=1)
    return list(_references[sampling.max_tokens])


async def assert_no_blocks_held(*sides: Side) -> None:
    for side in sides:
        load = await side.runner.call(side.engine.load)
        assert load.num_free_blocks == NUM_BLOCKS and load.num_running == 0
        assert len(side.engine.reservations) == 0 and side.slots.num_busy == 0 and side.inbox.num_incoming == 0


async def test_driver_moves_the_request_and_the_client_follows(pair):
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b)
    result = await driver(a, FaultyPeer(b), copier).migrate_out(plan())
    handoff = await read(stream, tokens)
    assert isinstance(handoff, Handoff) and handoff.next_token_index == len(tokens) and handoff.epoch == 1
    attached = b.inbox.attach("r", handoff.epoch)
    last = await read(attached, tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    assert result.num_stages >= 2 and result.num_blocks == sum(t.num_blocks for t in copier.transfers)
    assert all(t.is_checksum_verified for t in copier.transfers)
    await assert_no_blocks_held(a, b)


async def test_the_picked_request_is_announced_before_anything_moves(pair):
    """MigrateOut names its pick and the migration's id at once (initial metadata), so a manager whose deadline
    passes meanwhile can ask the destination whether it holds that request under that migration (the migration
    runs on here); a second move of the same request over the same pair has another id."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=5)
    copier = TensorCopier(a, b)
    announced = []

    async def on_picked(request_id: str, migration_id: str) -> None:
        announced.append((request_id, migration_id, len(copier.transfers)))

    await driver(a, FaultyPeer(b), copier).migrate_out(plan(request_id=""), on_picked=on_picked)
    ((request_id, migration_id, num_copied_then),) = announced
    assert (request_id, num_copied_then) == ("r", 0) and migration_id.startswith("a-")
    (held,) = b.engine.list_requests()
    assert (held.origin, held.migrated_from, held.migration_id) == (RequestOrigin.MIGRATED_IN, "a", migration_id)
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    await assert_no_blocks_held(a, b)


async def test_a_plans_short_prepare_deadline_holds_for_the_first_reservation_only(pair):
    """A PD hand-off waits parked while its destination prepares: a frozen one costs it --pd-handoff-hold-s,
    not --migration-rpc-timeout-s (5 s). Later calls that grow the reservation take the usual deadline."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer = FaultyPeer(b)
    await driver(a, peer, TensorCopier(a, b)).migrate_out(dataclasses.replace(plan(), prepare_timeout_s=0.5))
    assert peer.prepare_timeouts[0] == 0.5 and set(peer.prepare_timeouts[1:]) <= {None}
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    await assert_no_blocks_held(a, b)


class SlowFirstPrepare(FaultyPeer):
    """A destination whose first PrepareMigrateIn returns only once the source's request filled `num_blocks` more
    blocks (a busy destination, a slow network); notes the source's full blocks when that answer came back."""

    def __init__(self, dst: Side, src: Side, num_blocks: int) -> None:
        super().__init__(dst)
        self.src, self.num_blocks = src, num_blocks
        self.full_at_answer: set[int] | None = None  # source block ids full when the first Prepare answered

    async def prepare_migrate_in(self, *args, **kwargs) -> Reservation:
        is_first = self.full_at_answer is None
        if is_first:
            start = len(await self._full_blocks())
            async with asyncio.timeout(10):
                while len(await self._full_blocks()) < start + self.num_blocks:
                    await asyncio.sleep(0.005)
        reservation = await super().prepare_migrate_in(*args, **kwargs)
        if is_first:
            self.full_at_answer = set(await self._full_blocks())
        return reservation

    async def _full_blocks(self) -> tuple[int, ...]:
        def full() -> tuple[int, ...]:
            view = self.src.engine.migration_blocks("r")
            return tuple(view.block_ids[:view.num_full_blocks])
        return await self.src.runner.call(full)


async def test_blocks_filled_during_the_first_prepare_are_copied_live_not_paused(pair):
    """The first live stage copied the blocks full before the first PrepareMigrateIn, so those the request filled
    while a slow Prepare ran waited for the paused copy (more downtime; with one live stage, every one of them).
    It takes the request's blocks once Prepare answered: the paused copy has none that were full by then."""
    a, b = pair
    expected, tokens, stream = await decoding_alone_past(a, 10)
    peer, copier = SlowFirstPrepare(b, a, num_blocks=4), TensorCopier(a, b)
    await driver(a, peer, copier, max_stages=1).migrate_out(plan())
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    # The paused copy may have nothing to copy (no transfer): the request filled no block after the live stage
    # and its last KV position ended a block (a slow engine on a busy machine).
    live, *paused = copier.transfers
    paused_ids = {block_id for transfer in paused for block_id in transfer.src_block_ids}
    assert len(paused) <= 1
    assert peer.full_at_answer <= set(live.src_block_ids)
    assert not peer.full_at_answer & paused_ids, (len(live.src_block_ids), len(paused_ids))
    await assert_no_blocks_held(a, b)


async def test_a_drain_onto_a_prefill_instance_tells_it_the_manager_chose_it(pair):
    """A PREFILL destination refuses migrations in unless the first Prepare says so (the last decode instance
    drained: nowhere else to go); the manager's MigrateOut says it, the source passes it on."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer = FaultyPeer(b)
    request = instance_pb2.MigrateOutRequest(dst_instance_id="b", dst_address="127.0.0.1:2", request_id="r",
                                             can_decode_on_prefill=True)
    await driver(a, peer, TensorCopier(a, b)).migrate_out(migrate_out_plan_from_proto(request))
    assert peer.prepare_on_purpose[0] is True
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    await assert_no_blocks_held(a, b)


GRPC_SHM = (TransferBackend.GRPC, TransferBackend.SHM)


async def decoding_past_30(a: Side) -> tuple[list[int], list[int], RequestStream]:
    """The reference tokens, and request "r" running on `a` with its first 30 tokens read (and the list of them)."""
    return await reference(a), *await running_past(a, 30)


async def decoding_alone_past(a: Side, until: int) -> tuple[list[int], list[int], RequestStream]:
    """PROMPT run alone on `a` first (its own tokens: a windowed pair's differ from the shared references), then
    request "r" running on `a` with its first `until` tokens read (and the list of them)."""
    return await run_alone(a, SAMPLING.max_tokens), *await running_past(a, until)


async def running_past(a: Side, until: int) -> tuple[list[int], RequestStream]:
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=until)
    return tokens, stream


@pytest.mark.parametrize(("own_transfer_id", "offered", "expected"), [
    ("tb", GRPC_SHM, TransferBackend.SHM),  # our transfer service maps the destination too: one host
    ("tb", (TransferBackend.GRPC,), TransferBackend.GRPC),  # ... but does not offer shm
    ("ta", GRPC_SHM, TransferBackend.GRPC),  # the destination's KV is mapped by another service
    ("", GRPC_SHM, TransferBackend.GRPC),  # no transfer service known
    ("ta", (TransferBackend.GLOO, TransferBackend.SHM), TransferBackend.GLOO)])  # another host, and no grpc offered
async def test_auto_backend_copies_in_shared_memory_only_within_one_transfer_service(pair, own_transfer_id, offered,
                                                                                     expected):
    a, b = pair  # b's reservations name transfer service "tb"
    expected_tokens, tokens, stream = await decoding_past_30(a)
    copier = TensorCopier(a, b)
    result = await driver(a, FaultyPeer(b), copier, backend=None, transfer_id=own_transfer_id,
                          offered=offered).migrate_out(plan())
    assert result.backend is expected and {t.backend for t in copier.transfers} == {expected}
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected_tokens
    await assert_no_blocks_held(a, b)


async def test_auto_backend_follows_a_new_life_of_the_transfer_service(pair):
    """The co-located transfer service came back under another id (transfer_link.py follows it): the backend is
    picked by the new id, here the destination's own service (shm), where the old id said another host (grpc)."""
    a, b = pair  # b's reservations name transfer service "tb"
    expected_tokens, tokens, stream = await decoding_past_30(a)
    copier = TensorCopier(a, b)
    migrations = driver(a, FaultyPeer(b), copier, backend=None, transfer_id="ta", offered=GRPC_SHM)
    migrations.use_transfer_service("tb", GRPC_SHM)
    assert (await migrations.migrate_out(plan())).backend is TransferBackend.SHM
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected_tokens
    await assert_no_blocks_held(a, b)


async def test_shm_named_for_a_destination_of_another_transfer_service_is_refused_before_any_copy(pair):
    """A black-box run on three loopback "hosts" with the manager's --migration-backend shm: a migration across
    hosts failed in the source's transfer service with "instance ... is not mapped by transfer service ...;
    call MapInstance on it first (or start it with --map-instances)", advice that cannot work on another host."""
    a, b = pair  # b's reservations name transfer service "tb"
    expected_tokens, tokens, stream = await decoding_past_30(a)
    copier = TensorCopier(a, b)
    with pytest.raises(FailedPrecondition, match="shm backend copies only between .*b's is mapped by transfer "
                                                 "service 'tb', this instance's by 'ta'.*auto"):
        await driver(a, FaultyPeer(b), copier, backend=TransferBackend.SHM, transfer_id="ta").migrate_out(plan())
    assert copier.transfers == []
    await read(stream, tokens)  # it went on here
    assert tokens == expected_tokens
    await assert_no_blocks_held(a, b)


@pytest.mark.parametrize("fault", ["prepare", "commit", "transfer-live", "transfer-final"])
async def test_every_failure_before_commit_resumes_on_the_source(pair, fault):
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer, copier = FaultyPeer(b), TensorCopier(a, b)
    if fault in ("prepare", "commit"):
        peer.faults[fault] = Unavailable(f"{fault}: instance b is down")
    else:
        copier.fail_on = 1 if fault == "transfer-live" else 2  # one live stage, then the final one
        # The final stage copies only what the live one left: at a block boundary, with no token decoded
        # between, that was nothing, and the migration committed (seen once on a loaded machine).
        copier.decode_after_first = "r"
    with pytest.raises(Unavailable):
        await driver(a, peer, copier, max_stages=1).migrate_out(plan())
    assert peer.calls[-1] == "abort_migrate_in"
    last = await read(stream, tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_request_finishing_mid_migration_aborts_it(pair):
    a, b = pair
    tokens: list[int] = []
    sampling = dataclasses.replace(SAMPLING, max_tokens=60)  # it ends while the copy is held: 400 cost 20 s at load 8
    stream = await a.runner.add("r", PROMPT, sampling)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, pause=asyncio.Event())
    with paced(a):  # its last 30 steps outlast the move's way to its first copy (about 11 steps at load 12)
        migration = asyncio.create_task(driver(a, FaultyPeer(b), copier).migrate_out(plan()))
        while not copier.num_calls:
            assert not migration.done(), migration
            await asyncio.sleep(0.01)
    await read(stream, tokens)  # the first stage's copy is stuck; the request runs to its end meanwhile
    copier.pause.set()
    with pytest.raises(Aborted, match="finished or was aborted"):
        await migration
    assert len(tokens) == sampling.max_tokens
    await assert_no_blocks_held(a, b)


async def test_commit_lost_on_the_way_back_drops_the_copy_on_the_destination(pair):
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=10)
    peer = FaultyPeer(b)

    async def commit_then_fail(migration_id, state, attempt=0):
        await b.inbox.commit(migration_id, state)
        raise Unavailable("deadline exceeded: the commit's answer never came")

    peer.commit_migrate_in = commit_then_fail
    with pytest.raises(Unavailable):
        await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    with pytest.raises(NotFound):
        b.inbox.attach("r", 1)  # the destination dropped its copy
    await read(stream, tokens)
    assert tokens == expected
    await assert_no_blocks_held(a, b)


async def test_a_last_copy_starting_just_inside_the_refresh_interval_keeps_its_reservation_to_the_commit(pair):
    """The Prepare's answer came back late (a busy destination, a slow network), so the last copy started just
    inside the driver's refresh interval, which left a copy its whole deadline but not the commit after it:
    the destination's watchdog, sweeping as such a copy and commit may end (simulated: the sweep's clock is
    moved on), freed the reservation, and the commit failed NOT_FOUND."""
    a, b = pair
    reservation_timeout_s, transfer_timeout_s, rpc_timeout_s = 1.0, 0.5, 0.3
    b.inbox = MigrationInbox(b.runner, b.slots, reservation_timeout_s, TransferEndpoint("127.0.0.1:1", "tb"))
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer, copier = FaultyPeer(b), TensorCopier(a, b)
    prepare, transfer = peer.prepare_migrate_in, copier.transfer

    async def first_answer_late(*args, **kwargs) -> Reservation:
        reservation = await prepare(*args, **kwargs)
        if len(peer.calls) == 1:
            await asyncio.sleep(0.35)  # past the refresh interval needed (0.2 s), within the one there was (0.5 s)
        return reservation

    async def copy_and_commit_taking_their_deadlines(transfer_, timeout_s, request_id=None) -> TransferResult:
        await b.inbox.expire(time.monotonic() + transfer_timeout_s + 0.9 * rpc_timeout_s)
        return await transfer(transfer_, timeout_s, request_id)
    peer.prepare_migrate_in, copier.transfer = first_answer_late, copy_and_commit_taking_their_deadlines
    mover = driver(a, peer, copier, reservation_timeout_s=reservation_timeout_s, transfer_timeout_s=transfer_timeout_s,
                   rpc_timeout_s=rpc_timeout_s)
    await mover.migrate_out(dataclasses.replace(plan(), max_stages=0))  # one stage: the request does not grow
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_lost_reservation_is_detected_before_more_copies(pair):
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, pause=asyncio.Event())
    mover = driver(a, FaultyPeer(b), copier, reservation_timeout_s=1.0)  # = the transfer timeout: every copy re-prepares
    migration = asyncio.create_task(mover.migrate_out(plan()))
    while not copier.num_calls:
        await asyncio.sleep(0.01)
    await b.inbox.expire(float("inf"))  # b's watchdog fires while the first stage copies
    copier.pause.set()
    with pytest.raises(Aborted, match="reservation here is gone"):
        await migration
    await read(stream, tokens)
    await assert_no_blocks_held(a, b)


async def test_refusals(pair):
    a, b = pair
    copier = TensorCopier(a, b)
    with pytest.raises(FailedPrecondition, match="--transfer-address"):
        await driver(a, FaultyPeer(b), None).migrate_out(plan())
    with pytest.raises(FailedPrecondition, match="no request to migrate"):
        await driver(a, FaultyPeer(b), copier).migrate_out(plan(request_id=""))
    with pytest.raises(NotFound):
        await driver(a, FaultyPeer(b), copier).migrate_out(plan(request_id="nobody"))
    with pytest.raises(Aborted, match="gone"):  # growing a reservation b does not hold
        await b.inbox.prepare("never-prepared", "x", "c", 1, grow_only=True)
    await b.inbox.prepare("other", "x", "c", 1)  # b's only migration slot is busy (the refusal above took none)
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, [], until=2)
    with pytest.raises(ResourceExhausted, match="max-concurrent-migrations"):
        await driver(a, FaultyPeer(b), copier).migrate_out(plan())
    assert await b.inbox.abort("other")
    await a.runner.abort("r")
    await assert_no_blocks_held(a, b)


async def test_a_destinations_refusal_by_role_is_told_apart_from_the_sources_own(pair):
    """The PD hand-off tries the next decode instance after a destination's refusal by role, and must not after a
    FAILED_PRECONDITION of the source's own (no --transfer-address), which every destination would meet."""
    a, b = pair
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, [], until=2)
    peer = FaultyPeer(b)
    peer.faults["prepare"] = FailedPrecondition("instance b has role prefill and takes no migrations in")
    with pytest.raises(RefusedByDestination, match="role prefill"):
        await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    with pytest.raises(FailedPrecondition, match="--transfer-address") as own:
        await driver(a, FaultyPeer(b), None).migrate_out(plan())
    assert not isinstance(own.value, RefusedByDestination)
    await a.runner.abort("r")
    await assert_no_blocks_held(a, b)


async def test_a_pick_for_a_destination_serving_shorter_sequences_takes_a_request_that_fits(pair):
    """The manager's MigrateOut names the destination's max_model_len: the source picks among the requests
    that fit it (prompt + max_tokens), since the destination refuses the others; with none, it says why."""
    a, b = pair
    long_tokens: list[int] = []
    long = await a.runner.add("long", PROMPT, SAMPLING)  # 20 + 120 tokens
    await read(long, long_tokens, until=2)
    short_tokens: list[int] = []
    short = await a.runner.add("short", PROMPT, dataclasses.replace(SAMPLING, max_tokens=100))  # 20 + 100
    await read(short, short_tokens, until=2)
    request = instance_pb2.MigrateOutRequest(dst_instance_id="b", dst_address="127.0.0.1:2", dst_max_model_len=119,
                                             selection=instance_pb2.MIGRATION_SELECTION_LONGEST_RUNNING)
    with pytest.raises(FailedPrecondition, match="none that fits the destination's max_model_len of 119 tokens"):
        await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(migrate_out_plan_from_proto(request))
    request.dst_max_model_len = 120
    result = await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(migrate_out_plan_from_proto(request))
    assert result.request_id == "short"
    handoff = await read(short, short_tokens)
    await read(b.inbox.attach("short", handoff.epoch), short_tokens)
    await a.runner.abort("long")
    await assert_no_blocks_held(a, b)


async def test_a_waiting_request_moves_without_blocks(pair):
    a, b = pair
    expected = await reference(a)
    with paced(a):  # the busy requests hold every batch slot of a until r moved
        busy = [await a.runner.add(f"busy-{i}", [9 + i] * 8, SAMPLING) for i in range(4)]
        for stream in busy:
            await read(stream, [], until=1)
        tokens: list[int] = []
        stream = await a.runner.add("r", PROMPT, SAMPLING)
        copier = TensorCopier(a, b)
        result = await driver(a, FaultyPeer(b), copier).migrate_out(plan())
    assert result.num_blocks == 0 and not copier.transfers
    handoff = await read(stream, tokens)
    assert isinstance(handoff, Handoff) and handoff.next_token_index == 0
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected
    for i in range(4):
        await a.runner.abort(f"busy-{i}")
    await assert_no_blocks_held(a, b)


async def test_a_request_parked_at_its_first_token_moves_with_no_engine_call(pair):
    """PD push: the runner parks a request in the step that made its first token (it decodes no
    second token there) and hands its state to `on_prefilled`; the one-stage move uses that."""
    a, b = pair
    expected = await reference(a)
    parked = {}
    a.runner.holds_first_tokens = lambda: True
    a.runner.on_prefilled = lambda request_id, held: parked.setdefault(request_id, held)
    try:
        tokens: list[int] = []
        stream = await a.runner.add("r", PROMPT, SAMPLING)
        await read(stream, tokens, until=1)
        while "r" not in parked:
            await asyncio.sleep(0.001)
        held = parked["r"]
        assert held is not None and held.state.output_token_ids == tuple(tokens) == tuple(expected[:1])
        await asyncio.sleep(0.05)  # steps may run meanwhile: the parked request must not decode
        assert (await a.runner.call(a.engine.load)).num_running == 0
        copier = TensorCopier(a, b)
        moved = MigrateOutPlan(request_id="r", dst_instance_id="b", dst_address="127.0.0.1:2", dst_transfer_address="",
                               backend=None, max_stages=0, held=held)
        result = await driver(a, FaultyPeer(b), copier).migrate_out(moved)
        handoff = await read(stream, tokens)
        assert isinstance(handoff, Handoff) and handoff.next_token_index == 1
        await read(b.inbox.attach("r", handoff.epoch), tokens)
        assert tokens == expected and result.num_stages == 1 and len(copier.transfers) == 1
    finally:
        a.runner.holds_first_tokens = lambda: False
        a.runner.on_prefilled = None
    await assert_no_blocks_held(a, b)


async def test_the_load_report_counts_a_request_parked_or_suspended_for_its_move(pair):
    """Out of the batch, a request counts as neither running nor waiting: one parked for its PD hand-off (this
    instance runs those itself) and one a migration suspended for its last stage (maybe one a previous leader
    started) made a draining instance look empty, and an operator who stopped it then lost the request."""
    a, b = pair
    servicer = servicer_moving_to(a, FaultyPeer(b))
    parked = {}
    a.runner.holds_first_tokens = lambda: True
    a.runner.on_prefilled = lambda request_id, held: parked.setdefault(request_id, held)
    try:
        stream = await a.runner.add("r", PROMPT, SAMPLING)
        await read(stream, [], until=1)
        while "r" not in parked:
            await asyncio.sleep(0.001)
        await a.runner.call(lambda: None)  # the load snapshot after that step
        report = servicer.load_report()
        assert (report.num_running, report.num_waiting, report.num_suspended) == (0, 0, 1)
        a.runner.holds_first_tokens = lambda: False
        assert await a.runner.call(lambda: a.engine.resume("r"))
        report = servicer.load_report()
        assert (report.num_running, report.num_suspended) == (1, 0)
        await a.runner.call(lambda: a.engine.suspend("r"))  # a migration's last stage
        report = servicer.load_report()
        assert (report.num_running, report.num_waiting, report.num_suspended) == (0, 0, 1)
        assert await a.runner.call(lambda: a.engine.resume("r"))
    finally:
        a.runner.holds_first_tokens = lambda: False
        a.runner.on_prefilled = None
    await read(stream, [0])
    await assert_no_blocks_held(a, b)


async def test_a_hand_off_that_cannot_release_the_request_ends_it_here(pair):
    """Once the client was told to go elsewhere, the request must not keep running here (a
    resume may bring it back under the same id): if the release fails, it is aborted."""
    a, _b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=2)
    with pytest.raises(FailedPrecondition):  # running, not suspended: nothing to release
        await a.runner.hand_off("r", Handoff("b", "127.0.0.1:2", 1, 2), stream)
    assert isinstance(await read(stream, tokens), Handoff)
    assert (await a.runner.call(a.engine.load)).num_running == 0
    await assert_no_blocks_held(a)


@pytest.mark.parametrize("max_stages", [3, 0], ids=["live", "stop-and-copy"])
async def test_blocks_the_destination_has_cached_are_not_copied(pair, max_stages):
    a, b = pair
    expected = await run_alone(b, SAMPLING.max_tokens)  # b computed (and cached) this very request's blocks
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    num_full = (len(PROMPT) + len(tokens) - 1) // BLOCK_SIZE  # 12 or more: full when the migration began
    copier = TensorCopier(a, b)
    migration_plan = dataclasses.replace(plan(), max_stages=max_stages)
    result = await driver(a, FaultyPeer(b), copier).migrate_out(migration_plan)
    handoff = await read(stream, tokens)
    num_blocks = -(-(len(PROMPT) + handoff.next_token_index - 1) // BLOCK_SIZE)  # the last token is not computed
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    assert result.num_cached_at_destination >= num_full
    # Only the blocks past the cached ones: the partial block, and those filled while it decoded on during the
    # migration (live: one or two; eight with a loaded machine's 0.3 s pause, so no fixed bound)
    copied = [i for t in copier.transfers for i in t.dst_block_ids]
    assert result.num_blocks == len(copied) == num_blocks - result.num_cached_at_destination
    await assert_no_blocks_held(a, b)


@pytest.mark.parametrize("max_stages", [3, 0], ids=["live", "stop-and-copy"])
async def test_a_windowed_request_moves_only_the_blocks_its_window_holds(windowed_pair, max_stages):
    """With a window on every layer, the blocks behind it went back on the source: none is copied (without:
    the first stage copied the ten given back before the move began), the destination gives back those
    places unread, and the request goes on with the tokens it had."""
    a, b = windowed_pair
    expected, tokens, stream = await decoding_alone_past(a, 30)
    copier = TensorCopier(a, b)
    result = await driver(a, FaultyPeer(b), copier).migrate_out(dataclasses.replace(plan(), max_stages=max_stages))
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    num_blocks = -(-(len(PROMPT) + handoff.next_token_index - 1) // BLOCK_SIZE)  # the last token is not computed
    num_dropped = num_blocks_out_of_window(len(PROMPT) + 30 - 1, BLOCK_SIZE, WINDOW)  # 10, before the move began
    assert result.num_blocks == sum(t.num_blocks for t in copier.transfers) <= num_blocks - num_dropped
    await assert_no_blocks_held(a, b)


async def test_a_windowed_request_keeps_the_destinations_cached_blocks_behind_its_window(windowed_pair):
    """The source's blocks behind the window are placeholders, so their checksums are not compared: the
    destination keeps its cached blocks there (without: every cached block was given up at the first)."""
    a, b = windowed_pair
    expected = await run_alone(b, SAMPLING.max_tokens)  # b computed (and cached) this very request's blocks
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    num_full = (len(PROMPT) + len(tokens) - 1) // BLOCK_SIZE
    result = await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and result.num_cached_at_destination >= num_full
    await assert_no_blocks_held(a, b)


@pytest.mark.parametrize("max_stages", [3, 0], ids=["live", "stop-and-copy"])
async def test_a_windowed_request_moves_to_a_destination_with_room_for_its_window_only(windowed_pair, max_stages):
    """The destination reserves no block for the entries behind the window (num_leading_blocks_not_held): with
    12 blocks free where the block table has 25 entries, it takes the request (without: RESOURCE_EXHAUSTED at
    the first Prepare, which asked for all of them), which goes on with the tokens it had; no block leaks."""
    a, b = windowed_pair
    expected = await run_alone(a, SAMPLING.max_tokens)
    hog = await b.runner.call(lambda: b.engine.block_manager.allocate_blocks(NUM_BLOCKS - 12))
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=80)
    num_dropped = num_blocks_out_of_window(len(PROMPT) + 80 - 1, BLOCK_SIZE, WINDOW)
    assert num_dropped >= 23 and -(-(len(PROMPT) + 80) // BLOCK_SIZE) > 12
    peer = FaultyPeer(b)
    result = await driver(a, peer, TensorCopier(a, b)).migrate_out(dataclasses.replace(plan(), max_stages=max_stages))
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    assert result.num_blocks <= 2 * (-(-WINDOW // BLOCK_SIZE) + 1)
    await b.runner.call(lambda: b.engine.block_manager.free_blocks(hog))
    await assert_no_blocks_held(a, b)


class OlderDestination(FaultyPeer):
    """A destination from before num_leading_blocks_not_held: it ignores it (reserves a block for every entry)
    and echoes none."""

    async def prepare_migrate_in(self, *args, num_leading_blocks_not_held=0, **kwargs) -> Reservation:
        return await super().prepare_migrate_in(*args, **kwargs)


async def test_a_windowed_request_does_not_move_to_a_destination_too_old_for_its_window(windowed_pair):
    """The source copies no block behind the window; an older destination reserved real blocks there and, at
    the commit, cached them as the request's prefix though nothing was copied into them (a later request sharing
    the prefix would read stale K/V: wrong tokens, no error). Its reply echoes no placeholder count, so the move
    is aborted before any copy; the request goes on with its tokens and nothing leaks."""
    a, b = windowed_pair
    expected, tokens, stream = await decoding_alone_past(a, 80)
    copier = TensorCopier(a, b)
    with pytest.raises(Aborted, match="older version"):
        await driver(a, OlderDestination(b), copier).migrate_out(plan())
    assert copier.transfers == []
    last = await read(stream, tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_request_that_reads_an_entry_the_destination_holds_no_block_for_stays(windowed_pair, monkeypatch):
    """As after a preemption between the first Prepare and the commit of a live move (a stop-and-copy one
    reserves from the suspended request's view): the first view says one entry more is
    behind the window than the request reads at the end. The source copies nothing into a placeholder and
    keeps the request, committing nothing (without its check: the commit went out and the destination refused
    it); the request goes on with its tokens and nothing leaks."""
    a, b = windowed_pair
    expected, tokens, stream = await decoding_alone_past(a, 30)
    views = 0
    real = a.engine.migration_blocks

    def first_overstated(request_id):
        nonlocal views
        view, views = real(request_id), views + 1
        return dataclasses.replace(view, num_dropped_blocks=view.num_dropped_blocks + 1) if views == 1 else view
    monkeypatch.setattr(a.engine, "migration_blocks", first_overstated)
    a.engine.step = lambda: []  # r decodes no further during the move: nothing gives back the overstated entry
    try:
        peer = FaultyPeer(b)
        with pytest.raises(Aborted, match="reserved none"):
            await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    finally:
        del a.engine.step  # the class's again
    assert "commit" not in peer.calls
    await read(stream, tokens)
    assert tokens == expected
    await assert_no_blocks_held(a, b)


async def test_a_destination_without_a_window_refuses_entries_not_held(pair):
    """Its model reads every block: a Prepare naming leading entries the source does not hold is refused."""
    _, b = pair
    with pytest.raises(InvalidArgument, match="num_leading_blocks_not_held"):
        await b.inbox.prepare("m", "r", "a", 10, num_leading_blocks_not_held=4)
    with pytest.raises(InvalidArgument, match="num_leading_blocks_not_held"):
        await b.inbox.prepare("m2", "r", "a", 10, num_leading_blocks_not_held=-1)
    await assert_no_blocks_held(b)


async def test_a_commit_that_would_read_an_entry_not_held_is_refused(windowed_pair):
    """A request recomputed on its source since the first Prepare (a preemption) may read entries behind the
    window again, for which the destination reserved no block: the destination refuses the commit (it would
    read another request's block there) and its reservation still frees every block it holds."""
    a, b = windowed_pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=5)  # 24 tokens computed: 4 blocks behind the window
    view = await a.runner.call(lambda: a.engine.suspend("r"))
    state = await a.runner.call(lambda: a.engine.export_state("r"))
    num_out = num_blocks_out_of_window(state.num_computed_tokens, BLOCK_SIZE, WINDOW)
    await b.inbox.prepare("m", "r", "a", view.num_blocks, num_leading_blocks_not_held=num_out + 1)
    with pytest.raises(FailedPrecondition, match="num_leading_blocks_not_held"):
        await b.inbox.commit("m", state)
    assert await b.inbox.abort("m")
    assert await a.runner.call(lambda: a.engine.resume("r"))
    await read(stream, tokens)
    await assert_no_blocks_held(a, b)


class PeerFromBefore(FaultyPeer):
    """A destination from before the cached blocks' checksums: its answers carry none."""

    async def prepare_migrate_in(self, *args, **kwargs) -> Reservation:
        return dataclasses.replace(await super().prepare_migrate_in(*args, **kwargs), cached_checksums=())


async def give_cached_block_other_bits(side: Side, tokens: list[int], index: int) -> None:
    """Change the bits of the block `side` cached for block `index` of PROMPT + `tokens` (as if computed otherwise)."""
    context = PROMPT + tokens
    hashes: list[bytes] = []
    for i in range(index + 1):
        hashes.append(next_block_hash(hashes, context[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
    block_id = side.engine.block_manager.cached_blocks(hashes)[index]
    await side.runner.call(lambda: side.engine.kv_cache.tensor[:, :, block_id].add_(1.0))


@pytest.mark.parametrize("max_stages", [3, 0], ids=["live", "stop-and-copy"])
async def test_cached_blocks_are_copied_over_from_the_first_whose_bits_differ(pair, max_stages):
    a, b = pair
    expected = await run_alone(b, SAMPLING.max_tokens)  # b computed (and cached) this very request's blocks
    await give_cached_block_other_bits(b, expected, 3)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier, peer = TensorCopier(a, b), FaultyPeer(b)
    result = await driver(a, peer, copier).migrate_out(dataclasses.replace(plan(), max_stages=max_stages))
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    assert result.num_cached_at_destination == 3 and peer.calls.count("prepare") >= 2
    num_blocks = -(-(len(PROMPT) + handoff.next_token_index - 1) // BLOCK_SIZE)  # the last token is not computed
    assert result.num_blocks == sum(t.num_blocks for t in copier.transfers) == num_blocks - 3
    await assert_no_blocks_held(a, b)


async def test_a_destination_from_before_checksums_keeps_every_cached_block(pair):
    a, b = pair
    expected = await run_alone(b, SAMPLING.max_tokens)
    await give_cached_block_other_bits(b, expected, 3)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    result = await driver(a, PeerFromBefore(b), TensorCopier(a, b)).migrate_out(plan())
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert result.num_cached_at_destination >= (len(PROMPT) + 30) // BLOCK_SIZE  # as they are, block 3 too
    await assert_no_blocks_held(a, b)


async def test_a_request_recomputed_during_its_migration_is_checked_again_once_paused(pair):
    """The first check kept b's 7 cached blocks; then the request is preempted and its blocks computed again
    while a live copy is under way, block 3 with other bits (as a recompute cut elsewhere gives them): once
    paused it is checked again, and blocks 3 on are copied, during the downtime."""
    a, b = pair
    cached_run = await b.runner.add("ref", PROMPT, dataclasses.replace(SAMPLING, max_tokens=9))
    await read(cached_run, [])  # b caches this request's first 7 blocks (its 28 computed tokens), with its bits
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier, peer = TensorCopier(a, b, pause=asyncio.Event()), FaultyPeer(b)
    migration = asyncio.create_task(driver(a, peer, copier).migrate_out(plan()))
    while not copier.num_calls:  # the first live stage copies blocks 7 on
        await asyncio.sleep(0.01)
    assert peer.calls == ["prepare"] and copier.transfers[0].src_block_ids  # every cached block kept so far

    def recomputed_with_other_bits() -> int:
        request = a.engine._request("r")
        request.num_preemptions += 1
        a.engine.kv_cache.tensor[:, :, request.block_table[3]].add_(1.0)
        return request.block_table[3]
    block_3 = await a.runner.call(recomputed_with_other_bits)
    copier.pause.set()
    result = await migration
    assert result.num_cached_at_destination == 3
    assert block_3 in copier.transfers[-1].src_block_ids  # copied in the last copy, the request paused
    assert all(block_3 not in t.src_block_ids for t in copier.transfers[:-1])
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    await assert_no_blocks_held(a, b)


async def test_keep_cached_blocks_is_for_a_later_call_only(pair):
    _, b = pair
    with pytest.raises(InvalidArgument, match="keep_cached_blocks"):
        await b.inbox.prepare("m-x", "r-x", "a", num_blocks=1, keep_cached_blocks=0)
    assert b.slots.num_busy == 0 and b.inbox.num_incoming == 0


async def test_more_block_hashes_than_blocks_is_invalid(pair):
    _, b = pair
    with pytest.raises(InvalidArgument, match="block_hashes"):
        await b.inbox.prepare("m-x", "r-x", "a", num_blocks=1, block_hashes=(b"x" * 16, b"y" * 16))
    assert b.slots.num_busy == 0 and b.inbox.num_incoming == 0


async def moved_a_to_b(a: Side, b: Side) -> tuple[RequestStream, list[int]]:
    """Request "r" started on a and migrated to b 30 tokens in; its stream on a (the hand-off still
    unread) and its tokens so far."""
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())
    return stream, tokens


async def test_a_resume_replaces_a_migrated_in_request_nobody_attached_to(pair):
    """The source died between the commit and the hand-off reaching the client: the client resumes the
    request with Generate, here of all places, and the orphan must make way (the chaos test found it)."""
    a, b = pair
    expected = await reference(a)
    stream, tokens = await moved_a_to_b(a, b)
    assert isinstance(await read(stream, tokens), Handoff)  # the hand-off that, in the failure, never arrives
    assert await b.inbox.drop_unattached("r")
    assert not await b.inbox.drop_unattached("r") and b.inbox.num_incoming == 0
    resumed = await b.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens))
    last = await read(resumed, tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_resume_arriving_while_a_commit_admits_its_request_takes_its_place(pair):
    """The source stalled with its commit under way (its streams ended UNAVAILABLE): the client resumes the
    request on the destination while the commit's import waits there for a long engine step. The resume
    takes the copy's place, and the commit fails. Before, the resume was refused as a duplicate id
    (InvalidArgument, which the frontend does not retry: the client got an error) and the copy decoded
    for nobody until the destination's watchdog dropped it."""
    a, b = pair
    peer, resumed = FaultyPeer(b), []
    expected = await reference(a)
    tokens: list[int] = []
    await read(await a.runner.add("r", PROMPT, SAMPLING), tokens, until=30)

    async def commit_while_the_client_resumes(migration_id: str, state: RequestState, attempt: int = 0) -> None:
        with long_step(b) as step:  # the destination's engine is in a long step
            commit = asyncio.create_task(b.inbox.commit(migration_id, state))
            await wait_for(lambda: b.runner.stream("r") is not None)  # its import is queued on the engine thread
            a.runner.abandon_all(Unavailable("the engine step has run for 30 s"))  # the client leaves a ...
            dropping = asyncio.create_task(b.inbox.drop_unattached("r"))  # ... and resumes on b, as Generate does
            await wait_for(lambda: b.runner.stream("r") is None)  # the copy is dropped; its abort queued
            step.set()
        await dropping
        resumed.append(await b.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens)))
        await commit

    peer.commit_migrate_in = commit_while_the_client_resumes
    with pytest.raises(Aborted, match="given up"):
        await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    last = await read(resumed[0], tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_resume_on_the_source_during_the_commit_is_left_alone_by_the_hand_off(pair):
    """The client's stream broke during the commit and its frontend resumed the request on the source (every
    other instance was excluded or not serving): the hand-off belongs to the stream the migration began
    with, which is gone. Before, it ended the resumed request's stream with the old hand-off and aborted
    the resumed request."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    old = await a.runner.add("r", PROMPT, SAMPLING)
    await read(old, tokens, until=30)
    peer, resumed = FaultyPeer(b), []
    plain_commit = peer.commit_migrate_in

    async def commit_as_the_client_resumes_here(migration_id: str, state: RequestState, attempt: int = 0) -> None:
        a.runner.abort_soon(old)  # the stream broke: its request is aborted (Generate's finally) ...
        resumed.append(await a.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens)))  # ... and resumed
        await plain_commit(migration_id, state)

    peer.commit_migrate_in = commit_as_the_client_resumes_here
    await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    last = await read(resumed[0], tokens)
    assert not isinstance(last, Handoff) and last.finish_reason is FinishReason.LENGTH and tokens == expected
    assert b.runner.stream("r") is None and "abort_migrate_in" in peer.calls  # the copy nobody follows is dropped
    await assert_no_blocks_held(a, b)


async def test_an_attached_request_is_never_dropped_for_a_resume(pair):
    a, b = pair
    stream, tokens = await moved_a_to_b(a, b)
    handoff = await read(stream, tokens)
    attached = b.inbox.attach("r", handoff.epoch)
    assert not await b.inbox.drop_unattached("r")
    await read(attached, tokens)
    await assert_no_blocks_held(a, b)


async def test_a_commit_of_a_request_already_running_on_the_destination_is_refused_as_a_lost_race(pair):
    """The client resumed the request on the destination (its source stalled) before the commit came: the
    commit lost a race, and says ABORTED (retry the whole move), which the manager counts under that reason.
    Before, INVALID_ARGUMENT, as if the source had sent a bad field."""
    a, b = pair
    tokens: list[int] = []
    await read(await a.runner.add("r", PROMPT, SAMPLING), tokens, until=30)
    resumed = await b.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens))
    with pytest.raises(Aborted, match="already running") as refused:
        await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())
    assert refused.value.grpc_code.name == "ABORTED"
    assert b.runner.stream("r") is resumed and b.inbox.num_incoming == 0  # the resume goes on; nothing reserved
    await a.runner.abort("r")
    await b.runner.abort("r")
    await assert_no_blocks_held(a, b)


async def test_a_request_moves_on_only_once_its_client_followed_it(pair, monkeypatch):
    """A→B, then B→A asked before the client attached on B: B waits for the client, so the client
    follows both hand-offs (moving it at once would send the client to B after B let it go)."""
    # 2 s by default, of which a busy machine can spend much before the client below attaches
    monkeypatch.setattr("services.instance.migration_pick.CLIENT_ATTACH_WAIT_S", 30.0)
    a, b = pair
    expected = await reference(a)
    with paced(b):  # r decodes on b through the 0.2 s below, and until it moved back
        stream, tokens = await moved_a_to_b(a, b)
        peer, attached_at_prepare = FaultyPeer(a), []
        prepare = peer.prepare_migrate_in

        async def prepare_noting_the_client(*args, **kwargs) -> Reservation:
            attached_at_prepare.append(b.runner.stream("r").is_attached)
            return await prepare(*args, **kwargs)
        peer.prepare_migrate_in = prepare_noting_the_client
        back = driver(b, peer, TensorCopier(b, a))
        with pytest.raises(FailedPrecondition, match="no request to migrate"):
            await back.migrate_out(plan(request_id="", dst="a"))  # picking skips a request nobody reads yet
        moving_back = asyncio.create_task(back.migrate_out(plan(dst="a")))
        await asyncio.sleep(0.2)
        assert not moving_back.done() and not attached_at_prepare  # waits for the client
        first = await read(stream, tokens)
        on_b = b.inbox.attach("r", first.epoch)
        second = await read(on_b, tokens)
    assert isinstance(second, Handoff) and second.epoch == 2 and (await moving_back).dst_instance_id == "a"
    assert attached_at_prepare[0]  # (the move's pace on a busy machine did not decide it)
    last = await read(a.inbox.attach("r", second.epoch), tokens)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_request_whose_client_never_follows_stays_put(pair, monkeypatch):
    monkeypatch.setattr("services.instance.migration_pick.CLIENT_ATTACH_WAIT_S", 0.2)
    a, b = pair
    with paced(b):  # r decodes on b through the 0.2 s wait
        stream, tokens = await moved_a_to_b(a, b)
        with pytest.raises(FailedPrecondition, match="client has not followed it"):
            await driver(b, FaultyPeer(a), TensorCopier(b, a)).migrate_out(plan(dst="a"))
    handoff = await read(stream, tokens)
    last = await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_client_leaving_during_the_last_copy_ends_the_migration_and_caches_nothing_wrong(pair):
    """The source frees an aborted request's blocks at once, and another request may write into them while
    they are copied: the migration must not commit what it copied, or the destination would cache another
    request's K/V under this one's block hashes (and serve later requests sharing the prefix from it)."""
    a, b = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer, copier = FaultyPeer(b), TensorCopier(a, b, pause=asyncio.Event())
    migration = asyncio.create_task(driver(a, peer, copier).migrate_out(dataclasses.replace(plan(), max_stages=0)))
    while not copier.num_calls:  # suspended; its one stop-and-copy stage is about to read the blocks
        await asyncio.sleep(0.01)
    context = PROMPT + tokens
    await a.runner.abort("r")  # the client went away: the blocks are free now ...
    filler = [((i * 7919) % 500) + 1 for i in range(600)]
    overwrite = await a.runner.add("s", filler, dataclasses.replace(greedy, max_tokens=1))
    await read(overwrite, [])  # ... and another request's K/V fill them
    copier.pause.set()
    with pytest.raises(Aborted, match="aborted during its last copy"):
        await migration
    assert "commit_migrate_in" not in peer.calls
    prompt = context[:48] + [3, 5]  # shares the migrated request's full blocks
    expected, got = [], []
    await read(await a.runner.add("q-ref", prompt, greedy), expected)
    await read(await b.runner.add("q", prompt, greedy), got)
    assert got == expected
    await assert_no_blocks_held(a, b)


async def test_a_client_leaving_right_after_the_commit_leaves_nothing_on_the_destination(pair):
    """The client went away between the commit and the hand-off: the source drops the copy on the
    destination with AbortMigrateIn, which also forgets the migration there. Before, it sent a plain
    Abort: the copy went, but the destination kept the committed migration until its reservation
    timeout, then logged it as expired (a `migration_in_expired` warning for every such client)."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=10)
    peer = FaultyPeer(b)
    plain_commit = peer.commit_migrate_in

    async def commit_then_client_leaves(migration_id: str, state: RequestState, attempt: int = 0) -> None:
        await plain_commit(migration_id, state)
        await a.runner.abort("r")
    peer.commit_migrate_in = commit_then_client_leaves
    await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    assert b.runner.stream("r") is None  # the copy is gone ...
    assert b.inbox.num_incoming == 0  # ... and so is its migration
    await assert_no_blocks_held(a, b)


async def test_a_commit_cancelled_during_its_import_leaves_no_copy_running_on_the_destination(pair):
    """gRPC cancels CommitMigrateIn's handler at the source's deadline; the import queued on the engine
    thread still runs. The request must not go on there with no stream (holding blocks and a batch slot,
    and refusing a later resume or migration under its id)."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer = FaultyPeer(b)

    async def commit_past_its_deadline(migration_id, state, attempt=0):
        with long_step(b):  # the destination's engine is in a long step
            handler = asyncio.create_task(b.inbox.commit(migration_id, state))
            await wait_for(lambda: b.runner.stream(state.request_id) is not None)  # the import is queued
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handler
        raise Unavailable("deadline exceeded: CommitMigrateIn")

    peer.commit_migrate_in = commit_past_its_deadline
    with pytest.raises(Unavailable):
        await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    assert await b.runner.call(lambda: [r.request_id for r in b.engine.list_requests()]) == []  # after the import
    await read(stream, tokens)  # finished on the source
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def test_two_migrations_naming_one_request_move_it_once(pair):
    """With --max-concurrent-migrations 2 (an operator's Migrate and a drain's, say), the second is refused
    and leaves the request to the first, which it must not resume under it."""
    a, b = pair
    a.slots = MigrationSlots(2)
    b.slots = MigrationSlots(2)
    b.inbox = MigrationInbox(b.runner, b.slots, timeout_s=5.0, transfer=TransferEndpoint("127.0.0.1:1", "tb"))
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    mover = driver(a, FaultyPeer(b), TensorCopier(a, b))
    results = await asyncio.gather(mover.migrate_out(plan()), mover.migrate_out(plan()), return_exceptions=True)
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 1 and isinstance(refused[0], FailedPrecondition), results
    last = await read(stream, tokens)
    assert isinstance(last, Handoff) and last.next_token_index == len(tokens)
    await read(b.inbox.attach("r", last.epoch), tokens)
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def test_a_request_parked_for_a_hand_off_that_no_longer_runs_decodes_here(pair):
    """PD push: the step that makes the first token parks the request (the role was PREFILL); a SetRole
    handled before that token reaches the event loop ends pushing. The request must decode here, not stay
    parked with its blocks and batch slot until its client gives up."""
    a, _ = pair
    role = {"now": InstanceRole.DECODE}  # switched between the engine thread's look and the delivery
    handoff = DecodeHandoff("a", a.runner, driver(a, None, None), placer=object(), mode=PdHandoff.PUSH,
                            role=lambda: role["now"])
    a.runner.holds_first_tokens = lambda: True  # what the engine thread saw a moment before
    a.runner.on_prefilled = handoff.note_prefilled
    tokens: list[int] = []
    await read(await a.runner.add("r", PROMPT, SAMPLING), tokens)
    assert tokens == await reference(a)


class DecodePlacer:
    """A manager that places every PD hand-off on instance b."""

    async def place_decode(self, request_id, src_instance_id, num_blocks, refused=(), max_num_tokens=0):
        return DecodePlace("b", "127.0.0.1:2")

    async def report_migration(self, result, started_at):
        pass

    async def report_failed_migration(self, plan, src_instance_id, error, started_at):
        pass


async def test_a_request_parked_for_pd_during_its_migration_is_moved_by_that_migration(pair):
    """A SetRole to PREFILL parks the request while a rebalancing migration of it runs: the PD hand-off is
    refused (the request is migrating) and leaves it to that migration, which must take it as it is
    rather than fail and leave it parked with nobody to resume it."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, pause=asyncio.Event())
    mover = driver(a, FaultyPeer(b), copier)
    migration = asyncio.create_task(mover.migrate_out(plan()))
    while not copier.num_calls:  # in its first live stage
        await asyncio.sleep(0.01)
    handoff = DecodeHandoff("a", a.runner, mover, DecodePlacer(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    assert await handoff.move_decoding() == 1  # parked at the next step boundary
    while await a.runner.call(lambda: a.engine._requests["r"].status.value) != "suspended":
        await asyncio.sleep(0.01)
    await handoff._hand_off("r")  # refused: r is migrating
    copier.pause.set()
    await migration
    last = await asyncio.wait_for(read(stream, tokens), 10)
    assert isinstance(last, Handoff)
    await asyncio.wait_for(read(b.inbox.attach("r", last.epoch), tokens), 30)
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def test_a_parked_request_whose_migration_fails_before_its_suspend_decodes_on(pair):
    """As above, but the migration fails in a live stage, before its own suspend: it resumes the request
    the PD hand-off parked and left to it."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, fail_on=1, pause=asyncio.Event())  # the first live-stage copy fails
    mover = driver(a, FaultyPeer(b), copier)
    migration = asyncio.create_task(mover.migrate_out(plan()))
    while not copier.num_calls:
        await asyncio.sleep(0.01)
    handoff = DecodeHandoff("a", a.runner, mover, DecodePlacer(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    assert await handoff.move_decoding() == 1
    while await a.runner.call(lambda: a.engine._requests["r"].status.value) != "suspended":
        await asyncio.sleep(0.01)
    await handoff._hand_off("r")  # refused: r is migrating; left to that migration
    copier.pause.set()
    with pytest.raises(Unavailable, match="is gone"):
        await migration
    last = await asyncio.wait_for(read(stream, tokens), 30)  # decodes on here to its end
    assert last.finish_reason is FinishReason.LENGTH and tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def a_hand_off_beside_a_failing_migration(a, b, placer: DecodePlacer):
    """Request r decoding on a (30 tokens read), a push hand-off queue for it, and a rebalancing migration
    of it started, whose copy will fail once `copier.pause` is set. r decodes on after that failure until the
    test hands it off: the test paces a meanwhile."""
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, fail_on=1, pause=asyncio.Event())
    mover = driver(a, FaultyPeer(b), copier)
    handoff = DecodeHandoff("a", a.runner, mover, placer, PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    migration = asyncio.create_task(mover.migrate_out(plan()))
    return stream, tokens, copier, handoff, migration


async def test_a_pd_hand_off_after_another_migration_resumed_its_request_sends_fresh_state(pair):
    """The request is parked for its PD hand-off (its state exported then) while a rebalancing migration of
    it runs; that migration fails and resumes it, and it decodes on. The hand-off, still queued, must send
    the request as it is now, not the state exported when it was parked."""
    a, b = pair
    stream, tokens, copier, handoff, migration = await a_hand_off_beside_a_failing_migration(a, b, DecodePlacer())
    with paced(a):  # r still decodes when its hand-off comes
        while not copier.num_calls:  # in its first live stage
            await asyncio.sleep(0.01)
        held = await a.runner.call(lambda: a.engine.hold_and_export("r"))  # parked at a step boundary
        handoff.note_prefilled("r", held)  # its hand-off is queued (no worker runs it yet)
        copier.pause.set()
        with pytest.raises(Unavailable, match="is gone"):
            await migration  # ... and resumed the request
        await read(stream, tokens, until=len(tokens) + 10)  # it decodes on
        await handoff._hand_off("r")  # the queued hand-off runs now
    await follow_the_hand_off_to_b(a, b, stream, tokens)


async def follow_the_hand_off_to_b(a, b, stream, tokens: list[int]) -> None:
    """The stream ends with a hand-off at the next token; read on from b: the reference, no block held."""
    last = await asyncio.wait_for(read(stream, tokens), 10)
    assert isinstance(last, Handoff) and last.next_token_index == len(tokens)
    await asyncio.wait_for(read(b.inbox.attach("r", last.epoch), tokens), 30)
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def test_a_request_migrated_in_before_its_first_token_onto_a_pushing_prefill_instance_is_queued(pair):
    """It is parked at its first token like any other: its hand-off must be queued too. Before, only
    Generate streams queued one, so it stayed parked (holding its blocks and slot) until the client's
    --generate-timeout-s."""
    a, b = pair
    mover = driver(b, FaultyPeer(a), TensorCopier(b, a))  # b can migrate (it has a transfer service)
    handoff = DecodeHandoff("b", b.runner, mover, DecodePlacer(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    b.runner.on_prefilled = handoff.note_prefilled
    b.runner.holds_first_tokens = lambda: handoff.is_pushing
    try:
        with paced(a):  # the busy requests hold every batch slot of a until r moved
            busy = [await a.runner.add(f"busy-{i}", [9 + i] * 8, SAMPLING) for i in range(4)]
            for stream in busy:
                await read(stream, [], until=1)
            stream = await a.runner.add("r", PROMPT, SAMPLING)  # waiting: no batch slot on a
            assert (await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())).num_blocks == 0
        tokens: list[int] = []
        last = await read(stream, tokens)
        assert isinstance(last, Handoff) and last.next_token_index == 0
        moved = b.inbox.attach("r", last.epoch)
        first = await asyncio.wait_for(moved.outputs.get(), 30)
        assert first.token_index == 0 and first.new_token_ids
        assert "r" in handoff._pending  # queued for its hand-off, which a worker (not running here) would do
    finally:
        for i in range(4):
            await a.runner.abort(f"busy-{i}")
        await b.runner.abort("r")


class PlaceOnA(DecodePlacer):
    async def place_decode(self, request_id, src_instance_id, num_blocks, refused=(), max_num_tokens=0):
        return DecodePlace("a", "127.0.0.1:1")


async def test_a_hand_off_waiting_for_a_client_leaves_a_copy_that_replaced_its_request_alone(pair, monkeypatch):
    """b pushes (PREFILL, two migration slots). r moved to b before its first token and was parked there
    for its hand-off, which waits for r's client; the client never came and resumed r on b itself. The
    waiting hand-off then moved the resumed copy with the orphan's saved state and freed blocks (found
    by review). Now it sees its copy was replaced and leaves the new one to decode here."""
    monkeypatch.setattr("services.instance.migration_pick.CLIENT_ATTACH_WAIT_S", 10.0)
    a, b = pair
    expected = await reference(a)
    b.slots = MigrationSlots(2)
    b.inbox = MigrationInbox(b.runner, b.slots, timeout_s=5.0, transfer=TransferEndpoint("127.0.0.1:2", "tb"))
    pushes = driver(b, FaultyPeer(a), TensorCopier(b, a))
    pusher = DecodeHandoff("b", b.runner, pushes, PlaceOnA(), PdHandoff.PUSH, lambda: InstanceRole.PREFILL)
    b.runner.on_prefilled = pusher.note_prefilled
    b.runner.holds_first_tokens = lambda: pusher.is_pushing
    with paced(a):  # the busy requests hold every batch slot of a until r moved
        busy = [await a.runner.add(f"busy-{i}", [9 + i] * 8, SAMPLING) for i in range(4)]
        for stream in busy:
            await read(stream, [], until=1)
        first = await a.runner.add("r", PROMPT, SAMPLING)  # waiting on a
        await driver(a, FaultyPeer(b), TensorCopier(a, b)).migrate_out(plan())  # the orphan on b
    assert isinstance(await read(first, []), Handoff)  # never reaches the client
    for i in range(4):
        await a.runner.abort(f"busy-{i}")
    while "r" not in pusher._held:
        await asyncio.sleep(0.01)
    stale = asyncio.create_task(pusher._hand_off("r"))
    await wait_for(lambda: "r" in pushes.moving)  # claimed: it waits for the orphan's client
    assert await b.inbox.drop_unattached("r")  # the client resumes r on b (Generate)
    tokens: list[int] = []
    resumed = await b.runner.add("r", PROMPT, SAMPLING)
    await stale
    last = await asyncio.wait_for(read(resumed, tokens), 30)
    assert tokens == expected and last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_a_copy_resumed_while_its_old_copys_hand_off_copies_gets_a_hand_off_of_its_own(pair):
    """a pushes (PREFILL). r's hand-off to b is in its copy when the frontend resumes r on a (it aborts the old copy
    and sends a new Generate); the new copy's first token comes with the old hand-off pending. Before, the new copy
    was resumed at once and decoded on the prefill instance; now the old hand-off fails (its copy is gone) and the
    new copy's own moves it to b."""
    a, b = pair
    expected = await reference(a)
    copier = TensorCopier(a, b, pause=asyncio.Event())
    pusher = DecodeHandoff("a", a.runner, driver(a, FaultyPeer(b), copier), DecodePlacer(), PdHandoff.PUSH,
                           lambda: InstanceRole.PREFILL)
    a.runner.on_prefilled = pusher.note_prefilled
    a.runner.holds_first_tokens = lambda: pusher.is_pushing
    workers = asyncio.create_task(pusher.handoff_loop())
    try:
        await read(await a.runner.add("r", PROMPT, SAMPLING), [], until=1)
        async with asyncio.timeout(10):
            while not copier.num_calls:  # the old copy's hand-off is in its copy
                await asyncio.sleep(0.01)
        await a.runner.abort("r")  # the frontend's resume of r here
        tokens: list[int] = []
        resumed = await a.runner.add("r", PROMPT, SAMPLING)
        await read(resumed, tokens, until=1)
        assert "r" in pusher._queued  # its own hand-off is queued (before: it was resumed here)
        copier.pause.set()
        last = await asyncio.wait_for(read(resumed, tokens), 30)
        assert isinstance(last, Handoff) and last.dst_instance_id == "b"
        await asyncio.wait_for(read(b.inbox.attach("r", last.epoch), tokens), 30)
        assert tokens == expected and pusher.num_handed_off == 1
        await assert_no_blocks_held(a, b)
    finally:
        copier.pause.set()  # (a failed check leaves the old copy's hand-off waiting in its copy)
        workers.cancel()
        await asyncio.gather(workers, return_exceptions=True)
        await pusher.close()


async def test_a_commit_racing_the_watchdog_leaves_no_copy_nobody_tracks_on_the_destination(pair):
    """The destination's watchdog gives the migration up (its source left etcd) while the commit's import
    waits behind a long engine step, and the source never hears back. The import must not survive as a
    request no incoming migration tracks: nobody would attach, the watchdog would never drop it, and a
    resume under its id would be refused there."""
    a, b = pair
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    peer = FaultyPeer(b)
    committed: list[BaseException | None] = []

    async def commit_while_the_source_is_declared_gone(migration_id, state, attempt=0):
        with long_step(b) as step:  # the destination's engine is in a long step
            committing = asyncio.create_task(b.inbox.commit(migration_id, state))
            await wait_for(lambda: b.runner.stream(state.request_id) is not None)  # the import is queued
            aborting = asyncio.create_task(b.inbox.abort(migration_id))  # the watchdog's sweep: the source left etcd
            await wait_for(lambda: b.inbox.num_incoming == 0)  # given up; its blocks are freed after the import
            step.set()
        await aborting
        committed.extend(await asyncio.gather(committing, return_exceptions=True))
        raise Unavailable("the source died: the commit's answer never reached it")

    peer.commit_migrate_in = commit_while_the_source_is_declared_gone
    with pytest.raises(Unavailable):
        await driver(a, peer, TensorCopier(a, b)).migrate_out(plan())
    assert isinstance(committed[0], Aborted), committed
    assert await b.runner.call(lambda: [r.request_id for r in b.engine.list_requests()]) == []
    assert b.runner.stream("r") is None
    await read(stream, tokens)  # finished on the source
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


class SlowDecodePlacer(DecodePlacer):
    """Places on b once `answer` is set."""

    def __init__(self) -> None:
        self.asked, self.answer = asyncio.Event(), asyncio.Event()

    async def place_decode(self, request_id, src_instance_id, num_blocks, refused=(), max_num_tokens=0):
        self.asked.set()
        await self.answer.wait()
        return await super().place_decode(request_id, src_instance_id, num_blocks)


async def test_a_pd_hand_off_whose_request_was_resumed_while_it_asked_for_a_place_sends_fresh_state(pair):
    """As above, but the worker had taken the parked state already and was waiting for the manager's
    PlaceDecode when the other migration failed and resumed the request. The hand-off must not move the
    request with the state it was parked with while it decodes on (the tokens made since would be lost,
    and the release of a request that is not suspended aborts it on both sides)."""
    a, b = pair
    placer = SlowDecodePlacer()
    stream, tokens, copier, handoff, migration = await a_hand_off_beside_a_failing_migration(a, b, placer)
    with paced(a):  # r still decodes when its hand-off gets its place
        while not copier.num_calls:  # in its first live stage
            await asyncio.sleep(0.01)
        held = await a.runner.call(lambda: a.engine.hold_and_export("r"))  # parked at a step boundary
        handoff.note_prefilled("r", held)
        pushing = asyncio.create_task(handoff._hand_off("r"))  # a worker takes it and asks for a place
        await placer.asked.wait()
        copier.pause.set()
        with pytest.raises(Unavailable, match="is gone"):
            await migration  # ... and resumed the request
        await read(stream, tokens, until=len(tokens) + 10)  # it decodes on
        placer.answer.set()
        await pushing
    await follow_the_hand_off_to_b(a, b, stream, tokens)


async def test_dropping_a_migrated_in_request_cut_short_by_its_callers_deadline_leaves_no_stream_behind(pair):
    """AbortMigrateIn (or a resume's Generate) drops a committed request nobody attached to while the engine
    is in a long step, and its caller's deadline cancels the call. The engine still aborts the request; its
    stream must go too, or a later resume under its id is refused as "already running" here, for good."""
    a, b = pair
    stream, tokens = await moved_a_to_b(a, b)
    assert isinstance(await read(stream, tokens), Handoff)  # the hand-off that never reaches the client
    with long_step(b):  # b's engine is in a long step
        dropping = asyncio.create_task(b.inbox.drop_unattached("r"))
        await wait_for(lambda: b.inbox.num_incoming == 0)  # forgotten; the request's abort is on its way ...
        await asyncio.sleep(0.05)  # ... and queued behind the step (a few turns of the event loop)
        dropping.cancel()  # the caller's deadline
        with pytest.raises(asyncio.CancelledError):
            await dropping
    async with asyncio.timeout(20):
        while b.runner.stream("r") is not None:  # the engine aborts the request once its step ends
            await asyncio.sleep(0.01)
    resumed = await b.runner.add("r", PROMPT, SAMPLING, resume_token_ids=tuple(tokens))
    await read(resumed, tokens)
    assert tokens == await reference(a)
    await assert_no_blocks_held(a, b)


async def test_a_client_attaching_leaves_an_earlier_failed_attempts_reservation_to_the_watchdog(pair):
    """A first attempt to move r to b failed and its AbortMigrateIn never reached b (b slow, a network blip):
    its reservation waits there for the watchdog. A second attempt commits and r's client attaches: the
    attach must not make b forget the first reservation, or nothing ever frees its blocks and batch slot."""
    a, b = pair
    b.slots = MigrationSlots(2)
    b.inbox = MigrationInbox(b.runner, b.slots, timeout_s=5.0, transfer=TransferEndpoint("127.0.0.1:2", "tb"))
    expected = await reference(a)
    await b.inbox.prepare("a-failed-attempt", "r", "a", num_blocks=12)  # its abort was lost
    stream, tokens = await moved_a_to_b(a, b)
    handoff = await read(stream, tokens)
    await read(b.inbox.attach("r", handoff.epoch), tokens)
    assert tokens == expected
    await b.inbox.expire(float("inf"))  # the watchdog's sweep, once the first reservation timed out
    await assert_no_blocks_held(a, b)


async def test_the_load_report_says_how_many_migration_slots_a_migrate_out_would_find_free(pair):
    """The manager's loop asks no source whose slots are all taken (its own PD hand-offs hold them): refused at
    once, such a MigrateOut was counted a failed migration and backed the pair off."""
    a, b = pair
    servicer = servicer_moving_to(a, FaultyPeer(b))
    report = servicer.load_report()
    assert report.HasField("num_free_migration_out_slots") and report.num_free_migration_out_slots == 1
    a.slots.acquire("a-pd-handoff")  # a hand-off of its own (or a migration in) holds the one slot
    try:
        assert servicer.load_report().num_free_migration_out_slots == 0
    finally:
        a.slots.release("a-pd-handoff")
    assert servicer.load_report().num_free_migration_out_slots == 1


async def test_a_migration_cancelled_before_its_task_first_ran_gives_its_slot_back():
    """close() (shutdown) cancels a migration whose task never started: its slot was taken all the same."""
    slots = MigrationSlots(1)
    settings = MigrationSettings(instance_id="a", transfer_backend=TransferBackend.GRPC, stage_blocks=2, max_stages=3,
                                 is_checksum_verified=True, rpc_timeout_s=1.0, transfer_timeout_s=1.0,
                                 reservation_timeout_s=5.0)
    migration_driver = MigrationDriver(None, settings, slots, lambda address: None, object())
    migrating = asyncio.create_task(migration_driver.migrate_out(plan()))
    await asyncio.sleep(0)  # slot taken, the migration's task created, not run yet
    assert slots.num_busy == 1
    await migration_driver.close()
    with pytest.raises(asyncio.CancelledError):
        await migrating
    assert slots.num_busy == 0



def servicer_moving_to(a: Side, peer: FaultyPeer) -> InstanceServicer:
    """a's gRPC servicer, its migrations going to `peer`."""
    servicer = InstanceServicer(a.runner)
    servicer.identity = InstanceIdentity(a.name, "127.0.0.1:1", InstanceRole.BOTH, "m", 1024, common_pb2.KvGeometry())
    servicer.migrations = driver(a, peer, TensorCopier(a, peer.dst))
    return servicer


async def streaming_on_a(a: Side, b: Side) -> tuple[FaultyPeer, InstanceServicer, AsyncIterator]:
    """Request "r" on a, its Generate stream open (nothing read yet); a's migrations go to b."""
    peer = FaultyPeer(b)
    servicer = servicer_moving_to(a, peer)
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    return peer, servicer, servicer._chunks(stream, from_token_index=0)


async def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_a_hand_off_its_client_never_read_drops_the_copy_on_the_destination(pair):
    """The client left as its request was handed off: the hand-off chunk sat queued on the source's stream,
    never read, so no frontend can attach to the copy. The stream closed with the hand-off unread makes the
    source drop the copy with AbortMigrateIn; before, it decoded for no client until the destination's
    watchdog dropped it after --migration-reservation-timeout-s (`migration_in_expired`, was_dropped=True)."""
    a, b = pair
    peer, servicer, chunks = await streaming_on_a(a, b)
    await anext(chunks)  # the frontend reads a first token ...
    await servicer.migrations.migrate_out(plan())  # ... and its client leaves as the request moves
    assert b.runner.stream("r") is not None and b.inbox.num_incoming == 1
    await chunks.aclose()  # gRPC ends the Generate stream with the hand-off still queued
    await wait_for(lambda: b.runner.stream("r") is None and b.inbox.num_incoming == 0)
    assert peer.calls.count("abort_migrate_in") == 1
    with pytest.raises(NotFound):  # the frontend's Abort, here where it last knew the request: done already
        await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
    await servicer.migrations.close()
    await assert_no_blocks_held(a, b)


async def test_an_abort_of_a_request_whose_hand_off_its_client_never_read_drops_the_copy(pair):
    """gRPC sent the hand-off chunk, but the frontend's client left before the frontend read it: the
    frontend aborts the request where it last knew it, on the source, which forwards it to the copy."""
    a, b = pair
    peer, servicer, chunks = await streaming_on_a(a, b)
    await servicer.migrations.migrate_out(plan())
    assert [chunk async for chunk in chunks][-1].HasField("handoff")  # sent, and never read
    reply = await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
    assert reply.was_running and b.runner.stream("r") is None and b.inbox.num_incoming == 0
    with pytest.raises(NotFound):
        await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
    await assert_no_blocks_held(a, b)


async def test_a_hand_off_its_client_read_leaves_the_copy_to_it(pair):
    """A frontend that read the hand-off attaches to the copy: the source's stream ending after it drops
    nothing, and an Abort of the request on the source after the attach (a late one) is refused there."""
    a, b = pair
    peer, servicer, chunks = await streaming_on_a(a, b)
    await servicer.migrations.migrate_out(plan())
    handoff_chunk = [chunk async for chunk in chunks][-1]
    await chunks.aclose()
    attached = b.inbox.attach("r", handoff_chunk.handoff.epoch)
    assert "abort_migrate_in" not in peer.calls
    with pytest.raises(NotFound):
        await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
    assert peer.calls.count("abort_migrate_in") == 1 and b.runner.stream("r") is attached
    last = await read(attached, list(range(handoff_chunk.handoff.next_token_index)))
    assert last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)


async def test_hand_offs_are_remembered_within_a_bound(pair, monkeypatch):
    """For the destination's attach wait (--migration-reservation-timeout-s), and at most MAX_RECENT_HANDOFFS."""
    monkeypatch.setattr("services.instance.handoff.MAX_RECENT_HANDOFFS", 2)
    now = [1000.0]  # their clock (a process paused 0.2 s between the note and the first look made them old)
    monkeypatch.setattr("services.common.recent.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    a, b = pair
    mover = driver(a, FaultyPeer(b), TensorCopier(a, b), reservation_timeout_s=0.2)
    for request_id in ("r1", "r2", "r3"):
        mover._handed_off.note(request_id, Handoff("b", "127.0.0.1:2", 1, 0, f"m-{request_id}"))
    now[0] += 0.19
    assert mover.recent_handoff("r1") is None and mover.recent_handoff("r3").migration_id == "m-r3"
    now[0] += 0.02
    assert mover.recent_handoff("r3") is None


async def test_a_client_leaving_after_the_hand_off_before_attaching_leaves_nothing_on_the_destination(pair):
    """The client read the hand-off, then went away before its Attach: the frontend sends Abort to the
    destination, which frees the request and forgets its migration. Before, the destination kept the
    committed migration until its reservation timeout, then logged a `migration_in_expired` warning for
    every such client (found by black-box check #3)."""
    a, b = pair
    stream, tokens = await moved_a_to_b(a, b)
    assert isinstance(await read(stream, tokens), Handoff)
    servicer = InstanceServicer(b.runner)
    servicer.inbox = b.inbox
    reply = await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
    assert reply.was_running
    assert b.inbox.num_incoming == 0
    await assert_no_blocks_held(a, b)


async def test_a_migration_failing_after_its_caller_gave_up_leaves_no_unread_error(pair):
    """The manager's MigrateOut deadline passed (a source frozen mid-migration, a black-box run): the migration
    goes on and logs its own failure (`migration_aborted`), but `asyncio.shield` stops reading a task once its
    waiter is cancelled, so asyncio also logged the error as "Task exception was never retrieved", traceback
    and all."""
    a, b = pair
    expected = await reference(a)
    tokens: list[int] = []
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    await read(stream, tokens, until=30)
    copier = TensorCopier(a, b, pause=asyncio.Event(), fail_on=1)
    with unretrieved_errors() as unretrieved:
        migration = asyncio.create_task(driver(a, FaultyPeer(b), copier).migrate_out(plan()))
        while not copier.num_calls:  # the first live stage's copy is under way
            await asyncio.sleep(0.01)
        migration.cancel()  # the caller's deadline
        with pytest.raises(asyncio.CancelledError):
            await migration
        copier.pause.set()  # and the copy fails after all
        async with asyncio.timeout(10):
            while a.slots.num_busy:  # given back when the migration's task ends
                await asyncio.sleep(0.01)
        await collect_dropped_tasks()
        assert not unretrieved, unretrieved
    await read(stream, tokens)
    assert tokens == expected
    await assert_no_blocks_held(a, b)


class BusyTransferService(TensorCopier):
    """A transfer service whose staging slots stay busy: every copy is refused RESOURCE_EXHAUSTED."""

    async def transfer(self, transfer: BlockTransfer, timeout_s: float, request_id=None) -> TransferResult:
        self.num_calls += 1
        raise ResourceExhausted("all 4 staging slots stayed busy for 1.0 s; retry later or raise --num-staging-slots")


async def test_migrate_out_names_the_party_that_ran_out_of_room(pair):
    """A transfer service whose staging slots stayed busy and a destination with no room both end MigrateOut
    RESOURCE_EXHAUSTED. Before, the manager recorded both `refused` ("the destination refused"); the source's
    trailing metadata now says which party ran out (x-ferry-refused-by), over a real gRPC call."""
    a, b = pair
    stream = await a.runner.add("r", PROMPT, SAMPLING)
    tokens: list[int] = []
    await read(stream, tokens, until=2)
    servicer = servicer_moving_to(a, FaultyPeer(b))
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    instance_pb2_grpc.add_InstanceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    request = instance_pb2.MigrateOutRequest(request_id="r", dst_instance_id="b", dst_address="127.0.0.1:2")
    full = FaultyPeer(b)
    full.faults["prepare"] = ResourceExhausted("no batch slot for migration m: all 4 are taken")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            for migrations, party, says in (
                    (driver(a, FaultyPeer(b), BusyTransferService(a, b)), REFUSED_BY_TRANSFER,
                     "a transfer service had no room for the copy to b"),
                    (driver(a, full, TensorCopier(a, b)), REFUSED_BY_DESTINATION, "no batch slot")):
                servicer.migrations = migrations
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.MigrateOut(request, timeout=20)
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
                assert refused_by(error.value.trailing_metadata()) == party and says in error.value.details()
                assert not is_source_busy(error.value.trailing_metadata())
    finally:
        await server.stop(None)
    last = await read(stream, tokens)  # it went on here
    assert last.finish_reason is FinishReason.LENGTH
    await assert_no_blocks_held(a, b)
