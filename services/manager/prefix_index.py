"""Which instances were sent which prompt prefixes: the memory of the `prefix` dispatch policy.

A prefix is named by its chunk keys (services/common/prefix_hash.py): key k is a chained
hash of the prompt's first k + 1 chunks, so two prompts share key k exactly when they
share every token up to the end of chunk k. The index maps each key to the instances the
leader last dispatched a request with that key to. It records dispatches, not cache
contents: an instance may have evicted the blocks since, a migration may have moved them,
and a new leader starts empty. It is a hint, and a wrong hint costs one prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.manager.domain import InstanceId

DEFAULT_MAX_KEYS = 65536
MAX_HOLDERS = 4  # instances remembered per key: a hot prefix that spilled over stays reachable on a few


class PrefixIndex:
    """Chunk key → the instances it was dispatched to (at most MAX_HOLDERS, newest first), bounded LRU."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self._max_keys = max_keys
        # Invariant: len <= max_keys; order is least recently recorded first (the next to go).
        self._holders: OrderedDict[int, tuple[InstanceId, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, key: int) -> tuple[InstanceId, ...]:
        """The instances `key` was last dispatched to, newest first (no LRU touch)."""
        return self._holders.get(key, ())

    def record(self, keys: Sequence[int], instance_id: InstanceId) -> None:
        """Note that a request with `keys` went to `instance_id`; evict the least recent keys past the bound.

        Keys are touched last to first, so a prompt's leading keys end most recent: they are the
        ones other prompts share, and a tail key is useless once the keys before it are gone."""
        for key in reversed(keys):
            previous = self._holders.pop(key, ())
            self._holders[key] = (instance_id, *(i for i in previous if i != instance_id))[:MAX_HOLDERS]
        while len(self._holders) > self._max_keys:
            self._holders.popitem(last=False)

    def num_matched(self, keys: Sequence[int], instance_ids: Iterable[InstanceId]) -> dict[InstanceId, int]:
        """Per instance, how many leading `keys` it holds (stopping at its first miss)."""
        matched = dict.fromkeys(instance_ids, 0)
        alive = set(matched)
        for depth, key in enumerate(keys, start=1):
            alive.intersection_update(self._holders.get(key, ()))
            if not alive:
                break
            for instance_id in alive:
                matched[instance_id] = depth
        return matched
