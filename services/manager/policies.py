"""Dispatch policies: which serving instance gets a new request.

Each policy is a small class behind `DispatchPolicy`. The caller (the dispatcher) has
already filtered the candidates: every one is SERVING, can prefill, and is not excluded,
and their loads include the reservations of earlier dispatches. A policy only ranks (and
remembers its own choices: round_robin its cursor, prefix what it sent where).
Ties always break by instance id (candidates arrive sorted by id, and every key ends
with the id), never by dict order. `load` and `balanced` rank an instance whose batch is
full (no free slot reported, reservations counted) after every instance with one: a request
sent there waits in its queue while another instance would start it now (README "Dispatch
under bursts" has the measurement).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from services.manager.domain import Candidate, DispatchAsk
from services.manager.prefix_index import DEFAULT_MAX_KEYS, PrefixIndex

DEFAULT_PREFIX_LOAD_SLACK = 4  # requests: how much longer than the shortest queue `prefix` lets a holder's be


class DispatchPolicy(abc.ABC):
    """Picks one of a non-empty list of candidates, sorted by instance id."""

    name: str

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        """The candidate the request should run on."""


class LoadPolicy(DispatchPolicy):
    """Highest freeness: the most free KV blocks per running request; a free batch slot first."""

    name = "load"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return min(candidates, key=lambda c: (_is_batch_full(c), -c.freeness, c.instance_id))


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
        return min(candidates, key=lambda c: (_is_batch_full(c), -c.freeness / (1 + c.load.num_waiting),
                                              c.instance_id))


def _is_batch_full(candidate: Candidate) -> bool:
    """No batch slot free for the request (one that does not report slots counts as having one)."""
    return not candidate.load.has_free_slot


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


_LOAD = LoadPolicy()  # prefix's choice when no candidate within the slack holds the prompt's first chunk


class PrefixPolicy(DispatchPolicy):
    """Prefix-cache affinity with a load term: a prompt goes where its prefix most likely is cached.

    The rule: among the candidates whose queue (running + waiting requests) is at most the
    shortest queue plus `load_slack`, take the one holding the most leading chunk keys of the
    prompt in the index (ties: highest freeness, then id). If none of them holds even the first
    key (or the ask has no keys), choose exactly as `load` does, over all candidates.

    Why: instances cache full KV blocks by chained hashes, so a request whose prompt starts like
    an earlier one skips that prefill where the earlier one ran. The manager cannot see the
    caches; like SGLang's cache-aware router it keeps an approximate index of what it
    dispatched where (`PrefixIndex`: bounded LRU, per leader, never told about evictions or
    migrations). Affinity alone would pile every request of a hot prefix (a shared system
    prompt) onto one instance; the slack bounds that pile-up to a few requests beyond the
    shortest queue, after which the request goes by load and its new instance becomes a second
    holder of the prefix. Migration still rebalances whatever affinity got wrong.
    """

    name = "prefix"

    def __init__(self, load_slack: int = DEFAULT_PREFIX_LOAD_SLACK, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if load_slack < 0:
            raise ValueError(f"load_slack must be >= 0 (requests), got {load_slack}")
        self._load_slack = load_slack
        self._index = PrefixIndex(max_keys)

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        chosen = self._by_affinity(candidates, ask.prefix_chunk_keys) or _LOAD.choose(candidates, ask)
        self._index.record(ask.prefix_chunk_keys, chosen.instance_id)
        return chosen

    def _by_affinity(self, candidates: Sequence[Candidate], keys: Sequence[int]) -> Candidate | None:
        """The candidate within the slack holding the longest prefix of `keys`; None if none holds any."""
        if not keys:
            return None
        max_queue = min(_queue(c) for c in candidates) + self._load_slack
        eligible = [c for c in candidates if _queue(c) <= max_queue]
        matched = self._index.num_matched(keys, (c.instance_id for c in eligible))
        best = min(eligible, key=lambda c: (-matched[c.instance_id], -c.freeness, c.instance_id))
        return best if matched[best.instance_id] else None


def _queue(candidate: Candidate) -> int:
    return candidate.load.num_running + candidate.load.num_waiting


class FloodPolicy(DispatchPolicy):
    """Always the first serving instance by id: piles load on one instance (migration tests)."""

    name = "flood"

    def choose(self, candidates: Sequence[Candidate], ask: DispatchAsk) -> Candidate:
        return candidates[0]


_POLICIES: dict[str, type[DispatchPolicy]] = {
    cls.name: cls for cls in (LoadPolicy, QueuePolicy, BalancedPolicy, RoundRobinPolicy, PrefixPolicy, FloodPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = LoadPolicy.name


def make_policy(name: str, *, prefix_load_slack: int = DEFAULT_PREFIX_LOAD_SLACK) -> DispatchPolicy:
    """A fresh policy by name (`prefix_load_slack` configures `prefix`); ValueError lists the valid names."""
    if name == PrefixPolicy.name:
        return PrefixPolicy(load_slack=prefix_load_slack)
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; one of: {', '.join(POLICY_NAMES)}") from None
