"""Exponential backoff with jitter for retry loops."""

from __future__ import annotations

import asyncio
import random


class Backoff:
    """`await backoff.sleep()` between failed attempts; `reset()` after a success."""

    def __init__(self, initial_s: float = 0.1, max_s: float = 2.0, factor: float = 2.0, jitter: float = 0.2) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self._factor = factor
        self._jitter = jitter
        self._next_s = initial_s
        self.num_attempts = 0

    @classmethod
    def up_to(cls, max_s: float, initial_s: float = 0.1) -> Backoff:
        """A backoff capped at `max_s`, starting at `initial_s` or at the cap if that is smaller
        (caps derived from short lease TTLs or intervals stay valid)."""
        return cls(initial_s=min(initial_s, max_s), max_s=max_s)

    def next_delay(self) -> float:
        delay = self._next_s * (1 + random.uniform(-self._jitter, self._jitter))
        self._next_s = min(self._next_s * self._factor, self.max_s)
        self.num_attempts += 1
        return min(delay, self.max_s)

    def reset(self) -> None:
        self._next_s = self.initial_s
        self.num_attempts = 0

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())
