"""Migration pairing: which instances hand a request to which, this tick.

The migration loop (migrator.py) builds one `Peer` per instance that can take part now
(reported recently, not at its limit of concurrent migrations, not waiting for a report
after its last migration) and asks for pairs:

* drains first: every DRAINING peer that still holds requests is a source, paired with
  the freest serving destination left (one pair per destination per tick);
* then PD hand-offs: every PREFILL peer with prefilled requests, paired with the freest
  DECODE peer left (`pair_prefilled`);
* then, if the load-balancing loop is on, the `PairingPolicy` pairs the serving peers
  that are left. A policy is a small class behind the ABC; `load` is the default.

Invariants of every plan: a peer is in at most one pair; a source is never its own
destination; both have a migration slot free (where they report them: one pool for migrations in
and out, which their own PD hand-offs may hold); a destination can decode (not PREFILL-only) and
has free blocks and a batch slot (a drain's last resort excepted). Among equally free
destinations the one that received a migration least recently goes first (so idle instances
take turns instead of the lowest id taking every request), then the instance id; never dict
order. No transport and no clock here.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.manager.domain import InstanceId, InstanceRecord, InstanceView, Load, Role, serves_shorter
from services.manager.migration import MigrationTrigger


@dataclass(frozen=True, slots=True)
class Peer:
    """An instance that can take part in a migration this tick."""

    instance_id: InstanceId
    address: str
    role: Role
    load: Load  # last report plus reservations: what it will hold, as a destination
    freeness: float
    is_draining: bool
    last_received_at: float = -math.inf  # when a migration to it last ended (the migrator's clock)
    reported: Load | None = None  # last report alone: what it holds now, what a move can take (None: `load`)
    max_model_len: int = 0  # longest sequence it serves (its etcd record); 0: not known
    record: InstanceRecord | None = None  # its etcd record (None: a peer made without one)

    @classmethod
    def of(cls, view: InstanceView, is_draining: bool, last_received_at: float = -math.inf) -> Peer:
        return cls(view.record.instance_id, view.record.address, view.record.role, view.load, view.load.freeness,
                   is_draining, last_received_at, view.reported_load, view.record.max_model_len, view.record)

    def holds_same_model(self, other: Peer) -> bool:
        """InstanceRecord.holds_same_model: an instance started with another --model is never paired with it
        (each tick tried it first, the freest, and failed its copy before trying the next-freest)."""
        return self.record is None or other.record is None or self.record.holds_same_model(other.record)

    @property
    def num_requests(self) -> int:
        return self.load.num_running + self.load.num_waiting

    @property
    def held(self) -> Load:
        """Its load as a source. A reservation is a request on its way (not movable yet) or, from an
        instance whose reports do not count the requests it took in, for up to IN_TRANSIT_S one the
        report counts already: counted twice, a lone request looked like two and moved to an idle
        instance at once, leaving it busy instead."""
        return self.load if self.reported is None else self.reported

    @property
    def num_held(self) -> int:
        return self.held.num_running + self.held.num_waiting

    @property
    def can_send(self) -> bool:
        """Has a migration slot free (where it reports them): without one a MigrateOut is refused at once."""
        return self.held.has_free_migration_slot

    @property
    def has_room(self) -> bool:
        """Decodes, has a free block and (where it reports them) a free batch slot."""
        return self.role is not Role.PREFILL and self.load.num_free_blocks > 0 and self.load.has_free_slot

    @property
    def can_receive(self) -> bool:
        """Has room and (where it reports them) a free migration slot (its own migrations, its PD hand-offs say,
        may hold them all): without both it refuses the migration (RESOURCE_EXHAUSTED), and the pair would back
        off while a destination with room waits."""
        return self.has_room and self.load.has_free_migration_slot


def destination_order(peer: Peer) -> tuple[float, float, str]:
    """Freest first; among equals, the one that received least recently; then by id."""
    return -peer.freeness, peer.last_received_at, peer.instance_id


def longest_first(src: Peer, destinations: Sequence[Peer]) -> list[Peer]:
    """`destinations` (in their order) that serve sequences as long as `src` does, then the rest: a drain
    that tried the freest first spent its grace on refusals while an instance that takes every request
    waited."""
    return sorted(destinations, key=lambda d: serves_shorter(src.max_model_len, d.max_model_len))


@dataclass(frozen=True, slots=True)
class Pair:
    src: Peer
    dst: Peer
    trigger: MigrationTrigger


PairFilter = Callable[[Peer, Peer], bool]  # may this (source, destination) pair migrate now (not backing off)?


def _any_pair(src: Peer, dst: Peer) -> bool:
    return True


def _assign(sources: Sequence[Peer], destinations: Sequence[Peer], trigger: MigrationTrigger,
            allowed: PairFilter) -> list[Pair]:
    """Each source in order with the first destination (in order) not yet taken that `allowed` lets it use: a
    destination that keeps refusing one source (backing off) leaves the next destination to it."""
    pairs: list[Pair] = []
    taken: set[InstanceId] = set()
    for src in sources:
        dst = next((d for d in longest_first(src, destinations) if d.instance_id not in taken and allowed(src, d)),
                   None)
        if dst is not None:
            pairs.append(Pair(src, dst, trigger))
            taken.add(dst.instance_id)
    return pairs


class PairingPolicy(abc.ABC):
    """Pairs loaded sources with free destinations among serving peers."""

    name: str

    @abc.abstractmethod
    def pair(self, peers: Sequence[Peer], threshold: float, allowed: PairFilter = _any_pair) -> list[Pair]:
        """(source, destination) pairs worth a migration, each `allowed`; each peer in at most one pair."""


class LoadPairing(PairingPolicy):
    """Most loaded with freest, second most loaded with second freest, ... (Llumnix's pairing).

    Sources are judged by what they hold (their last report), destinations by what they will
    hold (with the manager's reservations). A pair is worth it when the freeness gap exceeds `threshold` *and* (hysteresis) the
    destination would still be at least as free as the source after taking one average
    request of the source: so a move never makes the pair swap places, and the request
    it moved is never a reason to move it back (at worst the two end level: gap 0). Gaps only shrink towards the middle of the ranking:
    the first pair under the threshold ends the plan.
    """

    name = "load"

    def pair(self, peers: Sequence[Peer], threshold: float, allowed: PairFilter = _any_pair) -> list[Pair]:
        ranked = sorted(peers, key=lambda p: (p.held.freeness, p.instance_id))
        sources = [p for p in ranked if p.num_held > 0 and p.role is not Role.PREFILL and p.can_send]  # PREFILL: PD
        destinations = sorted((p for p in peers if p.can_receive), key=destination_order)
        pairs: list[Pair] = []
        used: set[InstanceId] = set()
        for src in sources:
            if src.instance_id in used:
                continue
            free = [d for d in destinations if d.instance_id not in used and d.instance_id != src.instance_id]
            src_freeness = src.held.freeness
            if not free or free[0].freeness - src_freeness <= threshold:
                break  # gaps only shrink from here
            dst = next((d for d in longest_first(src, free) if allowed(src, d) and d.freeness - src_freeness > threshold
                        and stays_freer_after_move(src.held, d.load)), None)
            if dst is not None:  # else every destination worth it backs off or cannot take one: the next source
                pairs.append(Pair(src, dst, MigrationTrigger.LOAD))
                used.update((src.instance_id, dst.instance_id))
        return pairs


def pair_drains(draining: Sequence[Peer], serving: Sequence[Peer], allowed: PairFilter = _any_pair,
                may_use_prefill: bool = True) -> list[Pair]:
    """Each draining peer that holds requests, by id, with the freest serving destination not yet taken.
    PREFILL instances take them only when no other serving instance can (the last decode instance is
    draining) and `may_use_prefill` (no decoding instance sits this tick out): they decode too, and hand the
    requests on once a decode instance serves again. In that last resort one with a free batch slot goes first."""
    destinations = sorted((p for p in serving if p.can_receive), key=destination_order)
    if may_use_prefill and not any(p.has_room for p in serving):  # (not one whose migration slots are busy a while)
        # A free batch slot first: one without refuses the move (RESOURCE_EXHAUSTED) unless a slot freed since
        destinations = sorted((p for p in serving if p.load.num_free_blocks > 0 and p.load.has_free_migration_slot),
                              key=lambda p: (not p.load.has_free_slot, *destination_order(p)))
    sources = [p for p in sorted(draining, key=lambda p: p.instance_id) if p.num_requests and p.can_send]
    return _assign(sources, destinations, MigrationTrigger.DRAIN, allowed)


def pair_prefilled(serving: Sequence[Peer], allowed: PairFilter = _any_pair) -> list[Pair]:
    """Each PREFILL peer with prefilled requests (by id) with the freest DECODE destination not yet taken;
    where no DECODE peer serves at all, the freest BOTH one (as PlaceDecode places a hand-off).

    The PD hand-off when the manager drives it (instances started with --pd-handoff manager),
    and the healing path in every mode: requests that decoded on a prefill instance while no
    decode instance served, or whose pushed hand-off failed, leave once one serves."""
    sources = sorted((p for p in serving if p.role is Role.PREFILL and p.load.num_prefilled > 0 and p.can_send),
                     key=lambda p: p.instance_id)
    role = Role.DECODE if any(p.role is Role.DECODE for p in serving) else Role.BOTH
    destinations = sorted((p for p in serving if p.role is role and p.can_receive), key=destination_order)
    return _assign(sources, destinations, MigrationTrigger.PD, allowed)


def stays_freer_after_move(src: Load, dst: Load) -> bool:
    """Would `dst` still be at least as free as `src` after one average request of `src` moved over?
    (A priority headroom stays where it is: migrations move the lowest-priority requests first.)"""
    num_blocks = blocks_per_request(src)
    if src.num_running:
        src_after = dataclasses.replace(src, num_running=src.num_running - 1,
                                        num_free_blocks=src.num_free_blocks + num_blocks)
    else:  # a queued request: it holds no blocks yet, it needs them
        src_after = dataclasses.replace(src, num_waiting=src.num_waiting - 1, num_blocks_needed_by_waiting=max(
            src.num_blocks_needed_by_waiting - num_blocks, 0))
    dst_after = dataclasses.replace(dst, num_running=dst.num_running + 1,
                                    num_free_blocks=dst.num_free_blocks - num_blocks)
    return dst_after.num_free_blocks >= 0 and dst_after.freeness >= src_after.freeness


def blocks_per_request(load: Load) -> int:
    """KV blocks an average request of the instance holds (running) or needs (queued, when none runs)."""
    if load.num_running:
        return math.ceil(max(load.num_total_blocks - load.num_free_blocks, 0) / load.num_running)
    return math.ceil(load.num_blocks_needed_by_waiting / max(load.num_waiting, 1))


_PAIRINGS: dict[str, type[PairingPolicy]] = {cls.name: cls for cls in (LoadPairing,)}
PAIRING_NAMES: tuple[str, ...] = tuple(_PAIRINGS)  # DEFAULT_PAIRING is one of them


def make_pairing(name: str) -> PairingPolicy:
    """A pairing policy by name; ValueError lists the valid names."""
    try:
        return _PAIRINGS[name]()
    except KeyError:
        raise ValueError(f"unknown migration pairing {name!r}; one of: {', '.join(PAIRING_NAMES)}") from None
