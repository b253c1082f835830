"""A table of closeable things by peer address (channels, clients), made on first use, closed once idle.

Fleets restart peers on fresh ports, so they meet new addresses for as long as they run: an
entry is not kept for ever. One no call has used for `idle_close_s` is closed when the next new
address is taken; one with a call under way (`Usage.call`) never is. The table is bounded: past
`max_entries` addresses, the least recently used entries with no call under way are closed
even before they idled that long (entries with calls under way can take it past the bound).

An address whose peer is known to be gone (a transfer service that left etcd or restarted) is
closed at once with `close_address`: an entry with no call under way now, one with calls under way
as soon as the last ends (a call to a dead peer fails by its deadline; one to a peer that is only
briefly away completes). Either way a later `take` makes a fresh one.

Closes run as tasks (taking an entry is synchronous); `wait_closed` waits for them, `close`
closes every entry (those waiting for their calls too) and waits for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import structlog

from services.common.error_text import typed_error_text

log = structlog.get_logger(__name__)

T = TypeVar("T")

IDLE_CLOSE_S = 600.0
MAX_ENTRIES = 4096  # addresses at once: far above any fleet's peers, a bound on a table that leaks


@dataclass(slots=True)
class Usage:
    """Calls under way on one entry, and when it was last taken or a call of it ended."""

    clock: Callable[[], float] = time.monotonic
    num_calls: int = 0
    last_used: float = field(default=0.0)
    on_unused: Callable[[], None] | None = field(default=None, repr=False)  # called (once) when the last call ends

    def __post_init__(self) -> None:
        self.last_used = self.clock()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count a call for its duration: the entry is not closed under it."""
        self.num_calls += 1
        try:
            yield
        finally:
            self.num_calls -= 1
            self.last_used = self.clock()
            if not self.num_calls and self.on_unused is not None:
                on_unused, self.on_unused = self.on_unused, None
                on_unused()

    def when_unused(self, callback: Callable[[], None]) -> None:
        """Call `callback` now if no call is under way, else once the last one ends."""
        if self.num_calls:
            self.on_unused = callback
        else:
            callback()

    def touch(self) -> None:
        self.last_used = self.clock()

    def idle_s(self) -> float:
        """How long no call has used it (0 while one is under way)."""
        return 0.0 if self.num_calls else self.clock() - self.last_used


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    value: T
    usage: Usage


class IdleClosingTable(Generic[T]):
    def __init__(self, close: Callable[[T], Awaitable[None]], name: str, idle_close_s: float = IDLE_CLOSE_S,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        """`close`: closes one value; `name`: what the values are, in logs and task names."""
        self._close = close
        self._name = name
        self._idle_close_s = idle_close_s
        self._clock = clock
        self._max_entries = max_entries
        self._entries: dict[str, Entry[T]] = {}
        self._closing: set[asyncio.Task[None]] = set()  # closes under way, kept until they end
        self._retired: dict[int, tuple[str, Entry[T]]] = {}  # out of the table, closed once their calls end (by id)

    def take(self, address: str, make: Callable[[Usage], T]) -> Entry[T]:
        """The entry of `address` (taking it counts as a use), made with `make(usage)` on first use;
        a new address first closes the entries idle for `idle_close_s` (and any past the bound)."""
        entry = self._entries.get(address)
        if entry is None:
            self._close_idle()
            usage = Usage(self._clock)
            entry = self._entries[address] = Entry(make(usage), usage)
        entry.usage.touch()
        return entry

    def get(self, address: str) -> Entry[T] | None:
        """`address`'s entry, if it has one (not counted as a use)."""
        return self._entries.get(address)

    def pop(self, address: str) -> Entry[T] | None:
        """Take `address`'s entry out of the table without closing it (the caller closes it)."""
        return self._entries.pop(address, None)

    def close_address(self, address: str, why: str) -> bool:
        """Take `address`'s entry out of the table and close it: now if no call is under way, else once the
        last one ends (a later `take` makes a fresh one meanwhile). False if the address had no entry."""
        entry = self._entries.pop(address, None)
        if entry is None:
            return False
        self._retired[id(entry)] = (address, entry)
        entry.usage.when_unused(lambda: self._close_retired(entry))
        log.info(f"{self._name}_closed", peer=address, why=why, num_calls=entry.usage.num_calls)
        return True

    def _close_retired(self, entry: Entry[T]) -> None:
        if (retired := self._retired.pop(id(entry), None)) is not None:
            self._close_soon(entry.value, retired[0])

    @property
    def addresses(self) -> list[str]:
        return list(self._entries)

    @property
    def num_retired(self) -> int:
        """Entries out of the table (`close_address`) whose calls have not all ended yet."""
        return len(self._retired)

    def _close_soon(self, value: T, address: str) -> None:
        task = asyncio.get_running_loop().create_task(self._close_logged(value, address),
                                                      name=f"close_{self._name}:{address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_logged(self, value: T, address: str) -> None:
        """Close one value in the background; a close that fails is logged (no one awaits the task for its error)."""
        try:
            await self._close(value)
        except Exception as exc:  # noqa: BLE001 - a close that fails leaves nothing more to do than say so
            log.warning("close_failed", what=self._name, address=address, error=typed_error_text(exc))

    async def wait_closed(self) -> None:
        """Wait for the closes under way; a waiter cancelled meanwhile leaves them to finish (shielded: a
        close cancelled before its first step never ran, and its value, already out of the table, stayed open)."""
        await asyncio.shield(asyncio.gather(*self._closing))

    async def close(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        entries += [entry for _, entry in self._retired.values()]
        self._retired = {}
        for entry in entries:
            await self._close(entry.value)
        await self.wait_closed()

    def _close_idle(self) -> None:
        for address, entry in list(self._entries.items()):
            if entry.usage.num_calls == 0 and entry.usage.idle_s() >= self._idle_close_s:
                self._evict(address, entry, "idle")
        unused = sorted((e.usage.last_used, a) for a, e in self._entries.items() if not e.usage.num_calls)
        for _, address in unused[:max(len(self._entries) + 1 - self._max_entries, 0)]:
            self._evict(address, self._entries[address], "over_bound")

    def _evict(self, address: str, entry: Entry[T], why: str) -> None:
        del self._entries[address]
        self._close_soon(entry.value, address)
        log.info(f"{self._name}_closed", peer=address, why=why, idle_s=round(entry.usage.idle_s()))
