"""What happened recently, by key: noted items kept for a while and up to a count, the oldest going first."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """The items noted within `max_age_s`, `max_items` at the most, by key (a key noted again counts from then)."""

    def __init__(self, max_age_s: float, max_items: int) -> None:
        self._max_age_s = max_age_s
        self._max_items = max_items
        self._items: dict[K, tuple[float, V]] = {}  # key → (monotonic, item), oldest first

    def note(self, key: K, item: V) -> None:
        self._items.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._items[key] = time.monotonic(), item
        self._forget_old()

    def get(self, key: K) -> V | None:
        self._forget_old()
        noted = self._items.get(key)
        return None if noted is None else noted[1]

    def forget(self, key: K) -> None:
        self._items.pop(key, None)

    def _forget_old(self) -> None:
        too_old = time.monotonic() - self._max_age_s
        while self._items:
            key, (noted_at, _) = next(iter(self._items.items()))
            if noted_at > too_old and len(self._items) <= self._max_items:
                return
            del self._items[key]
