"""Dispatch policies: which serving instance gets a new request.

Each policy is a small class behind `DispatchPolicy`. The caller (the dispatcher) has
already filtered the candidates: every one is SERVING, can prefill, and is not excluded,
and their loads include the reservations of earlier dispatches. A policy only ranks.
Ties always break by instance id (candidates arrive sorted by id, and every key ends
with the id), never by dict order.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from services.manager.domain import Candidate, DispatchAsk


class DispatchPolicy(abc.ABC):
    """Picks one of a non-empty list of candidates, sorted by instance id."""

    name: str

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        """The candidate the request should run on."""


class LoadPolicy(DispatchPolicy):
    """Highest freeness: the most free KV blocks per running request."""

    name = "load"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return min(candidates, key=lambda c: (-c.freeness, c.instance_id))


class QueuePolicy(DispatchPolicy):
    """Shortest queue: fewest waiting requests, then fewest running."""

    name = "queue"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return min(candidates, key=lambda c: (c.load.num_waiting, c.load.num_running, c.instance_id))


class BalancedPolicy(DispatchPolicy):
    """Freeness divided by (1 + waiting requests).

    `load` only sees KV memory: an instance whose batch is full (requests waiting for a
    slot) but whose cache is large still looks free. Dividing by the queue length makes
    a waiting queue cost as much as the memory it hides, without a unit-bearing weight.
    """

    name = "balanced"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return min(candidates, key=lambda c: (-c.freeness / (1 + c.load.num_waiting), c.instance_id))


class RoundRobinPolicy(DispatchPolicy):
    """The next instance by id after the one chosen last (wrapping), whatever the load.

    The cursor is an id, not an index, so instances joining or leaving never make it skip
    or repeat one.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last_id = ""

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        chosen = next((c for c in candidates if c.instance_id > self._last_id), candidates[0])
        self._last_id = chosen.instance_id
        return chosen


class FloodPolicy(DispatchPolicy):
    """Always the first serving instance by id: piles load on one instance (migration tests)."""

    name = "flood"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return candidates[0]


_POLICIES: dict[str, type[DispatchPolicy]] = {
    cls.name: cls for cls in (LoadPolicy, QueuePolicy, BalancedPolicy, RoundRobinPolicy, FloodPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = LoadPolicy.name


def make_policy(name: str) -> DispatchPolicy:
    """A fresh policy by name; ValueError lists the valid names."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; one of: {', '.join(POLICY_NAMES)}") from None
