"""The destination's watchdog outlives any error from one sweep and frees what expired on the next."""

from __future__ import annotations

import asyncio

import pytest

from services.instance.migration_in import MigrationInbox, TransferEndpoint
from services.instance.migration_slots import MigrationSlots
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FakeEngine:
    """Reserves blocks; freeing raises the scripted errors in turn."""

    def __init__(self, *free_errors: BaseException) -> None:
        self.free_errors = list(free_errors)
        self.reservations: dict[str, int] = {}
        self.freed: list[str] = []

    def reserve_blocks(self, migration_id: str, num_blocks: int, block_hashes=()) -> list[int]:
        self.reservations[migration_id] = num_blocks
        return list(range(num_blocks))

    def num_cached_reserved(self, migration_id: str) -> int:
        return 0

    def free_reservation(self, migration_id: str) -> bool:
        if self.free_errors:
            raise self.free_errors.pop(0)
        self.freed.append(migration_id)
        return self.reservations.pop(migration_id, None) is not None


class FakeRunner:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def call(self, fn):
        return fn()

    def stream(self, request_id: str) -> None:
        return None


async def test_the_watchdog_outlives_a_failed_abort_and_frees_the_rest():
    engine, slots = FakeEngine(RuntimeError("boom")), MigrationSlots(4)
    inbox = MigrationInbox(FakeRunner(engine), slots, timeout_s=0.04, transfer=TransferEndpoint("", ""))
    await inbox.prepare("m-1", "r-1", "src", num_blocks=2)
    await inbox.prepare("m-2", "r-2", "src", num_blocks=2)
    loop = asyncio.create_task(inbox.watchdog_loop())
    await until(lambda: engine.freed == ["m-2"], loop)
    assert inbox.num_incoming == 0 and slots.num_busy == 0
    await inbox.prepare("m-3", "r-3", "src", num_blocks=1)  # and it goes on sweeping
    await until(lambda: engine.freed == ["m-2", "m-3"], loop)
    await assert_cancels(loop)


async def test_a_reservation_is_freed_once_its_source_leaves_etcd_or_restarts():
    engine, slots = FakeEngine(), MigrationSlots(4)
    inbox = MigrationInbox(FakeRunner(engine), slots, timeout_s=60.0, transfer=TransferEndpoint("", ""),
                           transfer_timeout_s=5.0)
    members = {"a": {"host": "h", "pid": 1}, "b": {"host": "h", "pid": 2}, "c": {"host": "h", "pid": 3}}
    inbox.watch_sources(members)
    for migration_id, src in (("m-a", "a"), ("m-b", "b"), ("m-c", "c"), ("m-x", "never-registered")):
        await inbox.prepare(migration_id, f"r-{src}", src, num_blocks=2)
    now = asyncio.get_running_loop().time()
    await inbox.expire(now)
    assert engine.freed == [] and slots.num_busy == 4  # every source that etcd showed is still there
    del members["a"]  # killed or frozen: its lease expired
    members["b"] = {"host": "h", "pid": 22}  # restarted under the same id: it knows nothing of m-b
    members["c"] = {"host": "h", "pid": 3, "role": "decode"}  # a new role, the same process
    await inbox.expire(now)
    assert slots.num_busy == 2 and inbox.num_incoming == 2  # their slots go at once, for the next migration
    assert engine.freed == []  # their blocks wait out the copy deadline: a copy under way may still write
    await inbox.expire(now + 4.0)
    assert engine.freed == []
    await inbox.expire(now + 5.5)
    assert sorted(engine.freed) == ["m-a", "m-b"]
    assert inbox.num_incoming == 2  # m-c, and m-x from a source etcd never showed (left to the timeout)
