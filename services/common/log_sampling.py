"""Rate-limited log lines for events a client can cause at will (a refused call, a bad request).

A flood of bad clients must not flood the log: per key (say (event, method, code)) the first
occurrence is logged, then at most one line per `interval_s`, which carries `suppressed`, the
number of occurrences not logged since the key's last line. Metrics still count every one.

The key table is bounded (`max_keys`): a new key past the bound drops the key logged longest
ago, and with it that key's suppressed count (its next occurrence is logged as a first one).
Keys should come from a small set (a route, not a raw URL path) so that one client cannot
cycle through the table.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_KEYS = 1024


@dataclass(slots=True)
class _KeyState:
    logged_at: float  # when the key's last line was let through
    num_suppressed: int = 0  # occurrences held back since


class LogSampler:
    """Says which occurrences of a key to log: `admit(key)` is None for one to drop, else the
    number dropped since the key's last line (0 for a first occurrence)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError(f"LogSampler needs interval_s >= 0 and max_keys >= 1, got {interval_s}, {max_keys}")
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[Hashable, _KeyState] = OrderedDict()  # least recently logged first

    def admit(self, key: Hashable) -> int | None:
        now = self._clock()
        state = self._keys.get(key)
        if state is None:
            self._remember(key, now)
            return 0
        if now - state.logged_at < self._interval_s:
            state.num_suppressed += 1
            return None
        suppressed = state.num_suppressed
        self._keys[key] = _KeyState(logged_at=now)
        self._keys.move_to_end(key)
        return suppressed

    def __len__(self) -> int:
        return len(self._keys)

    def _remember(self, key: Hashable, now: float) -> None:
        while len(self._keys) >= self._max_keys:
            self._keys.popitem(last=False)
        self._keys[key] = _KeyState(logged_at=now)
