"""IdleClosingTable, shared by the instances' ChannelPool and the transfer service's TransferClients:
one value per address, closed once idle when a new address is taken, never under a call, bounded."""

from __future__ import annotations

import asyncio
import gc

import pytest

from services.common.idle_table import IdleClosingTable, Usage

pytestmark = pytest.mark.timeout(10)

IDLE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Table:
    """A table of address strings that records what it closed."""

    def __init__(self, clock: Clock, max_entries: int = 100) -> None:
        self.closed: list[str] = []
        self.usages: dict[str, Usage] = {}
        self.table: IdleClosingTable[str] = IdleClosingTable(self._close, "thing", IDLE_S, clock, max_entries)

    def take(self, address: str) -> str:
        return self.table.take(address, lambda usage: self._make(address, usage)).value

    def _make(self, address: str, usage: Usage) -> str:
        self.usages[address] = usage
        return address

    async def _close(self, value: str) -> None:
        await asyncio.sleep(0)
        self.closed.append(value)


async def test_one_value_per_address_made_once():
    things = Table(Clock())
    assert things.take("a") == "a" and things.take("a") == "a"
    assert things.table.addresses == ["a"] and list(things.usages) == ["a"]
    await things.table.close()
    assert things.closed == ["a"] and things.table.addresses == []


async def test_idle_values_close_when_a_new_address_is_taken_and_taking_counts_as_a_use():
    clock = Clock()
    things = Table(clock)
    things.take("a")
    things.take("b")
    clock.now += IDLE_S - 1
    things.take("b")  # taken again: its idle time starts over
    clock.now += 1
    things.take("a")  # an address it has: closes nothing
    assert things.closed == []
    clock.now += IDLE_S
    things.take("c")
    await things.table.wait_closed()
    assert sorted(things.closed) == ["a", "b"] and things.table.addresses == ["c"]


async def test_a_value_with_a_call_under_way_is_never_closed_and_idles_from_when_the_call_ended():
    clock = Clock()
    things = Table(clock)
    things.take("a")
    with things.usages["a"].call():
        clock.now += 10 * IDLE_S
        things.take("b")
        assert things.usages["a"].idle_s() == 0.0
    clock.now += IDLE_S - 1
    things.take("c")
    assert "a" in things.table.addresses
    clock.now += 1
    things.take("d")
    await things.table.wait_closed()
    assert sorted(things.closed) == ["a", "b"]  # b was taken when a's call ended


async def test_past_the_bound_the_least_recently_used_close_first_but_never_one_under_a_call():
    clock = Clock()
    things = Table(clock, max_entries=3)
    for address in "abc":
        things.take(address)
        clock.now += 1
    things.take("a")  # now the most recently used
    with things.usages["b"].call():
        things.take("d")  # b is the oldest, but busy: c goes
        await things.table.wait_closed()
        assert things.closed == ["c"] and things.table.addresses == ["a", "b", "d"]
    things.take("e")
    await things.table.wait_closed()
    assert things.closed == ["c", "a"] and sorted(things.table.addresses) == ["b", "d", "e"]
    await things.table.close()


async def test_pop_takes_a_value_out_unclosed():
    things = Table(Clock())
    things.take("a")
    entry = things.table.pop("a")
    assert entry is not None and entry.value == "a" and things.table.get("a") is None
    await things.table.close()
    assert things.closed == []


async def test_a_caller_cancelled_while_it_waits_for_the_closes_leaves_them_to_finish():
    """ChannelPool waits for the closes a new address started (`wait_closed`); a caller cancelled there (its
    client hung up) cancelled them too, and one not started yet never ran: a channel out of the table, never
    closed."""
    clock = Clock()
    things = Table(clock)
    things.take("a")
    clock.now += IDLE_S

    async def dial_a_new_address() -> None:
        things.take("b")  # starts a's close
        await things.table.wait_closed()
    caller = asyncio.ensure_future(dial_a_new_address())
    await asyncio.sleep(0)  # the caller now waits; a's close has not run a step yet
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    for _ in range(5):
        await asyncio.sleep(0)
    assert things.closed == ["a"] and things.table.addresses == ["b"]


async def test_a_close_that_fails_is_logged_and_leaves_no_error_unread():
    """A close runs as a task no one need await (its waiter may have been cancelled, and `shield` then stops
    reading it): its error must not reach asyncio's "Task exception was never retrieved"."""
    loop = asyncio.get_running_loop()
    unread: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))

    async def failing_close(_value: str) -> None:
        await asyncio.sleep(0)
        raise OSError("socket already gone")
    clock = Clock()
    table: IdleClosingTable[str] = IdleClosingTable(failing_close, "thing", IDLE_S, clock)
    table.take("a", lambda _usage: "a")
    clock.now += IDLE_S
    table.take("b", lambda _usage: "b")  # starts a's close
    waiter = asyncio.ensure_future(table.wait_closed())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0)
    assert unread == [] and table.addresses == ["b"]


async def test_close_address_closes_an_idle_value_at_once_and_a_busy_one_when_its_call_ends():
    """A peer known to be gone (a transfer service that left etcd or restarted) has its value closed at once,
    not after idling IDLE_S; one with a call under way keeps it until the call ends. Before, only the idle
    close existed."""
    things = Table(Clock())
    things.take("a")
    things.take("b")
    assert things.table.close_address("a", "peer_gone")
    await things.table.wait_closed()
    assert things.closed == ["a"] and things.table.addresses == ["b"]
    assert not things.table.close_address("a", "peer_gone")  # nothing left to close
    with things.usages["b"].call():
        assert things.table.close_address("b", "peer_gone")
        await things.table.wait_closed()
        assert things.closed == ["a"] and things.table.num_retired == 1  # under a call: kept
        assert things.take("b") == "b" and things.usages["b"] is not None  # a fresh one meanwhile
        fresh = things.table.get("b")
    await things.table.wait_closed()
    assert things.closed == ["a", "b"] and things.table.num_retired == 0
    assert things.table.get("b") is fresh  # the fresh one stays
    await things.table.close()
    assert things.closed == ["a", "b", "b"]


async def test_close_closes_values_still_waiting_for_their_calls():
    things = Table(Clock())
    things.take("a")
    usage = things.usages["a"]
    with usage.call():
        things.table.close_address("a", "peer_gone")
        await things.table.close()
        assert things.closed == ["a"]
    await things.table.wait_closed()
    assert things.closed == ["a"]  # not twice when the call ends
