"""The instance servicer around shutdown and role changes, on real engine runners (no sockets)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import llguidance
import pytest
from structlog.testing import capture_logs

from services.common.errors import FailedPrecondition, Unavailable
from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from services.instance import app
from services.instance.config import InstanceRole
from services.instance.convert import request_state_to_proto, sampling_to_proto
from services.instance.engine.migration_state import RequestState
from services.instance.server import InstanceIdentity, InstanceServicer
from tests.unit.instance import test_migration
from tests.unit.instance.test_migration import PROMPT, SAMPLING

pytestmark = pytest.mark.timeout(60)
pair, tiny = test_migration.pair, test_migration.tiny  # its fixtures: two engine runners on the tiny model


def servicer_for(side, role: InstanceRole = InstanceRole.BOTH) -> InstanceServicer:
    servicer = InstanceServicer(side.runner)
    servicer.identity = InstanceIdentity(side.name, "127.0.0.1:2", role, "m", 1024, common_pb2.KvGeometry())
    servicer.inbox = side.inbox
    return servicer


class FakeServer:
    async def set_serving(self, is_serving: bool) -> None:
        pass

    async def stop(self, grace: float) -> None:
        pass


async def test_a_commit_that_comes_after_sigterm_is_refused_so_the_source_keeps_the_request(pair):
    """Before, shutdown neither waited for a migration in nor refused its commit: the source handed its
    client to an instance on its way out, and the frontend had to recompute the request elsewhere."""
    _, b = pair
    servicer = servicer_for(b)
    await b.inbox.prepare("m-1", "r", "a", 2)  # reserved before SIGTERM, its copy under way
    await app.shutdown(SimpleNamespace(shutdown_grace_s=5.0), FakeServer(), servicer, b.runner, registry=None)
    state = RequestState(request_id="r", prompt_token_ids=tuple(PROMPT), output_token_ids=(), sampling=SAMPLING,
                         seed=5, priority=0, epoch=1, num_computed_tokens=0, text_sent="", num_resumed_tokens=0)
    with pytest.raises(Unavailable, match="not accepting migrations"):
        await servicer.CommitMigrateIn(instance_pb2.CommitMigrateInRequest(
            migration_id="m-1", state=request_state_to_proto(state)), None)
    assert b.runner.num_active == 0
    assert await b.inbox.abort("m-1")  # what the refused source does next


async def test_a_commit_under_way_when_sigterm_comes_is_refused_not_adopted_after_the_drain_was_decided(pair):
    """A commit that passed the accepting check before SIGTERM went on adopting the request while shutdown,
    seeing nothing running, decided not to drain itself: its client was handed to an instance on its way
    out, and the request was cut at the end of the grace (resumed by recompute)."""
    _, b = pair
    servicer = servicer_for(b)
    await b.inbox.prepare("m-1", "r", "a", 2)
    state = RequestState(request_id="r", prompt_token_ids=tuple(PROMPT), output_token_ids=(), sampling=SAMPLING,
                         seed=5, priority=0, epoch=1, num_computed_tokens=0, text_sent="", num_resumed_tokens=0)
    commit = asyncio.create_task(servicer.CommitMigrateIn(instance_pb2.CommitMigrateInRequest(
        migration_id="m-1", state=request_state_to_proto(state)), SimpleNamespace(time_remaining=lambda: None)))
    await asyncio.sleep(0)  # past the check, restoring the request's text off the event loop
    await app.shutdown(SimpleNamespace(shutdown_grace_s=0.5), FakeServer(), servicer, b.runner, registry=None)
    with pytest.raises(Unavailable, match="not accepting migrations"):
        await commit
    assert b.runner.num_active == 0
    assert await b.inbox.abort("m-1")


async def test_a_generate_building_its_grammar_when_sigterm_comes_is_refused_not_started_after_the_stop(pair):
    """The same race for a new request: its grammar is built off the event loop after the accepting check."""
    _, b = pair
    servicer = servicer_for(b)
    sampling = dataclasses.replace(SAMPLING, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z]{3}"))
    stream = servicer.Generate(instance_pb2.GenerateRequest(request_id="g", prompt_token_ids=PROMPT,
                                                            sampling=sampling_to_proto(sampling)), None)
    first = asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # past the check, building the grammar off the event loop
    await app.shutdown(SimpleNamespace(shutdown_grace_s=0.5), FakeServer(), servicer, b.runner, registry=None)
    with pytest.raises(Unavailable, match="not accepting new requests"):
        await first
    assert b.runner.num_active == 0


class StoppingServer(FakeServer):
    """grpc.aio's `stop(grace)` over the calls in `calls`: each may end within `grace`, then what is left is
    cancelled. `on_stop` runs as the stop begins."""

    def __init__(self, calls: list[asyncio.Task], on_stop=lambda: None) -> None:
        self.calls, self.on_stop = calls, on_stop

    async def stop(self, grace: float) -> None:
        self.on_stop()
        _, running = await asyncio.wait(self.calls, timeout=grace)
        for call in running:
            call.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def hold_the_last_token(engine, release: threading.Event) -> None:
    """`engine`'s step that finishes a request keeps its outputs (the last token) until `release` is set."""
    step = engine.step

    def held_step():
        outputs = step()
        if any(o.finish_reason is not None for o in outputs):
            release.wait(30)
        return outputs
    engine.step = held_step


async def generate_to_the_end(servicer: InstanceServicer, request_id: str, max_tokens: int) -> list:
    sampling = sampling_to_proto(dataclasses.replace(SAMPLING, max_tokens=max_tokens))
    return [chunk async for chunk in servicer.Generate(instance_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling), None)]


async def admitted(runner) -> None:
    """Until the request is in (a SIGTERM before would refuse it)."""
    async with asyncio.timeout(20):
        while not runner.num_active:
            await asyncio.sleep(0.01)


async def stopped(servicer: InstanceServicer, server: FakeServer, runner, grace_s: float) -> dict:
    """Shut down as SIGTERM does; the `instance_stopped` line."""
    with capture_logs() as logs:
        await app.shutdown(SimpleNamespace(shutdown_grace_s=grace_s), server, servicer, runner, registry=None)
    (line,) = [entry for entry in logs if entry["event"] == "instance_stopped"]
    return line


async def test_a_request_whose_last_token_comes_right_at_the_grace_deadline_is_not_counted_cut(pair):
    """Its last token was made as the grace ran out and reached the client in the server's stop: shutdown
    counted the streams still open before that stop, and logged `instance_stopped num_cut=1` for a request
    its client had whole."""
    _, b = pair
    servicer, release = servicer_for(b), threading.Event()
    hold_the_last_token(b.engine, release)
    call = asyncio.create_task(generate_to_the_end(servicer, "r-last", max_tokens=6))
    await admitted(b.runner)
    line = await stopped(servicer, StoppingServer([call], on_stop=release.set), b.runner, grace_s=0.3)
    chunks = await call
    assert chunks[-1].finish_reason != 0 and sum(len(c.token_ids) for c in chunks) == 6  # its client had it all
    assert line["num_cut"] == 0


async def test_a_request_still_running_when_the_servers_stop_ends_is_counted_cut(pair):
    _, b = pair
    servicer, release = servicer_for(b), threading.Event()
    hold_the_last_token(b.engine, release)
    call = asyncio.create_task(generate_to_the_end(servicer, "r-cut", max_tokens=6))
    try:
        await admitted(b.runner)
        line = await stopped(servicer, StoppingServer([call]), b.runner, grace_s=0.3)
    finally:
        release.set()
    assert call.cancelled() and line["num_cut"] == 1


async def test_a_set_role_whose_caller_gives_up_still_changes_the_record_and_then_the_role(pair):
    """Before, a deadline passing while the etcd record was written left the role changed here and not
    in etcd (the instance refused Generate as decode while the manager still dispatched to it)."""
    a, _ = pair
    servicer = servicer_for(a)
    may_write, written = asyncio.Event(), []

    async def slow_record(identity: InstanceIdentity) -> None:  # registry.update on a slow etcd
        await may_write.wait()
        written.append(identity.role)
    servicer.on_role_change = slow_record
    call = asyncio.create_task(servicer.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE), None))
    await asyncio.sleep(0.1)
    call.cancel()  # the admin's deadline
    with pytest.raises(asyncio.CancelledError):
        await call
    assert servicer.identity.role is InstanceRole.BOTH  # not before etcd has it
    may_write.set()
    async with asyncio.timeout(5):
        while servicer.identity.role is not InstanceRole.DECODE:
            await asyncio.sleep(0.01)
    assert written == [InstanceRole.DECODE]


async def test_a_set_role_whose_record_cannot_be_written_leaves_the_role_as_it_was(pair):
    a, _ = pair
    servicer = servicer_for(a)

    async def etcd_away(identity: InstanceIdentity) -> None:
        raise Unavailable("etcd is unreachable")
    servicer.on_role_change = etcd_away
    with pytest.raises(Unavailable):
        await servicer.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_PREFILL), None)
    assert servicer.identity.role is InstanceRole.BOTH


class SlowRegistry:
    """register() waits for `may_register` (a slow etcd at start); holds()/update() as the Registry's."""

    def __init__(self) -> None:
        self.may_register = asyncio.Event()
        self.records: dict[str, dict] = {}

    async def register(self, kind: str, member_id: str, value: dict) -> None:
        await self.may_register.wait()
        self.records[member_id] = value

    def holds(self, kind: str, member_id: str) -> bool:
        return member_id in self.records

    async def update(self, kind: str, member_id: str, value: dict) -> None:
        self.records[member_id] = value


class NoMarks:
    async def restored_role(self) -> InstanceRole:
        return InstanceRole.BOTH

    async def keep(self, role: InstanceRole) -> None:
        pass


async def test_a_set_role_while_the_instance_registers_reaches_its_record():
    """A restarted instance under its old address can get a SetRole (the manager still has its record) while
    it registers. Before, SetRole found nothing registered yet and left the record to register(), which wrote
    the role it had computed before: etcd said both while the instance refused Generate as decode."""
    registry, marks = SlowRegistry(), NoMarks()
    servicer = InstanceServicer(runner=None)
    servicer.identity = InstanceIdentity("i-0", "127.0.0.1:2", InstanceRole.BOTH, "m", 1024, common_pb2.KvGeometry())
    record = lambda identity: {"role": identity.role.value}  # noqa: E731
    servicer.on_role_change = app.role_writer(registry, marks, record)
    registering = asyncio.create_task(app.register_with_role(registry, marks, servicer, InstanceRole.BOTH, record))
    await asyncio.sleep(0.05)
    set_role = asyncio.create_task(servicer.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE), None))
    await asyncio.sleep(0.05)
    registry.may_register.set()
    await registering
    await set_role
    assert servicer.identity.role is InstanceRole.DECODE
    assert registry.records["i-0"] == {"role": "decode"}


async def test_a_prefill_instance_refuses_migrations_in_unless_chosen_on_purpose(pair):
    """Before, a PREFILL instance reserved for any migration in: a manager whose view still showed it decode (its
    record on its way, etcd away) placed decode work on it, and the request decoded there among the prefills."""
    _, b = pair
    servicer = servicer_for(b, InstanceRole.PREFILL)
    ask = dict(migration_id="m-1", request_id="r", src_instance_id="a", num_blocks=2)
    with pytest.raises(FailedPrecondition, match="role prefill"):
        await servicer.PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(**ask), None)
    assert b.engine.load().num_free_blocks == test_migration.NUM_BLOCKS  # nothing reserved
    # a drain with no other destination (the last decode instance drained) chose it on purpose
    reply = await servicer.PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(**ask, can_decode_on_prefill=True),
                                            None)
    assert len(reply.block_ids) == 2
    # one under way when the role changed goes on
    servicer.identity = dataclasses.replace(servicer.identity, role=InstanceRole.PREFILL)
    grown = await servicer.PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(**{**ask, "num_blocks": 3},
                                                                                  grow_only=True), None)
    assert len(grown.block_ids) == 3
    assert await b.inbox.abort("m-1")


async def test_while_a_set_role_writes_its_record_the_instance_refuses_only_what_both_roles_refuse(pair):
    """The record goes first, so managers act on the new role a write (the role mark's) before it is the role here.
    Before, a decode instance becoming prefill refused the Generate calls a manager already sent it as decode, and a
    prefill instance becoming decode refused the hand-offs placed on it as prefill."""
    a, b = pair
    may_write = asyncio.Event()

    async def slow_write(identity: InstanceIdentity) -> None:  # the record written, the role mark on its way
        await may_write.wait()
    generate = instance_pb2.GenerateRequest(request_id="g", prompt_token_ids=PROMPT,
                                            sampling=sampling_to_proto(SAMPLING))
    to_prefill = servicer_for(a, InstanceRole.DECODE)
    to_prefill.on_role_change = slow_write
    set_role = asyncio.create_task(to_prefill.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_PREFILL), None))
    await asyncio.sleep(0.05)
    stream = to_prefill.Generate(generate, None)
    assert (await anext(stream)).request_id == "g"  # taken, not refused as decode
    await stream.aclose()

    to_decode = servicer_for(b, InstanceRole.PREFILL)
    to_decode.on_role_change = slow_write
    set_decode = asyncio.create_task(to_decode.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE), None))
    await asyncio.sleep(0.05)
    await to_decode.PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
        migration_id="m-1", request_id="r", src_instance_id="a", num_blocks=2), None)  # taken, not refused as prefill
    assert await b.inbox.abort("m-1")
    may_write.set()
    await set_role
    await set_decode
    with pytest.raises(FailedPrecondition, match="role prefill"):  # each SetRole done: its role alone says
        await to_prefill.PrepareMigrateIn(instance_pb2.PrepareMigrateInRequest(
            migration_id="m-2", request_id="r", src_instance_id="b", num_blocks=2), None)
    with pytest.raises(FailedPrecondition, match="role decode"):
        await anext(to_decode.Generate(generate, None))


async def test_a_set_role_whose_record_cannot_be_written_refuses_as_before(pair):
    a, _ = pair
    servicer = servicer_for(a, InstanceRole.DECODE)

    async def etcd_away(identity: InstanceIdentity) -> None:
        raise Unavailable("etcd is unreachable")
    servicer.on_role_change = etcd_away
    with pytest.raises(Unavailable):
        await servicer.SetRole(instance_pb2.SetRoleRequest(role=common_pb2.ROLE_PREFILL), None)
    generate = instance_pb2.GenerateRequest(request_id="g", prompt_token_ids=PROMPT,
                                            sampling=sampling_to_proto(SAMPLING))
    with pytest.raises(FailedPrecondition, match="role decode"):
        await anext(servicer.Generate(generate, None))
