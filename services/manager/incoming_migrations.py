"""Migrations this manager started into each destination, counted in its load until a report of it shows them.

A destination's last load report may predate a migration just started into it (two in one tick, an admin
Migrate and the loop within one report interval, `--migration-max-per-instance` above 1): picked again on that
report, it refused the next one (RESOURCE_EXHAUSTED) for the batch slot, migration slot or blocks the first had
taken. So each migration started holds, in the manager's view of its destination, one running request, an
estimate of its blocks (as needed, like a dispatch's) and one migration slot (`Reservation`), until:

* a report of the destination shows it: its `num_incoming_migrations` (reserved by PrepareMigrateIn, or
  committed and not attached yet) plus the requests it took in by migrations since its previous report
  (`num_requests_migrated_in` rose: committed) exceed the migrations of ours it showed already (oldest first;
  one it shows stays shown: from then on its reports count it as reserved blocks, then as a running request);
* or the migration ends (MigrateOut answered, failed or was cut short): the migration loop then keeps the pair
  out until their next reports, which show what became of it.

Others' migrations into it (a PD push, another manager's) count in those figures too, so ours may be taken as
shown a report early: no worse than without this. Each keeps its source: the source's report counts the request
meanwhile, so the cluster's pooled freeness takes the held one out where its source is in the pool too
(domain.pooled_freeness). No clock, no transport.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from services.manager.domain import InstanceId, Reservation


@dataclass(slots=True)
class _Incoming:
    token: int
    num_blocks: int
    src_id: InstanceId  # the instance it comes from (its reports count the request until it leaves)
    is_shown: bool = False  # a report of the destination counts it (invariant: never goes back to False)


@dataclass(slots=True)
class IncomingMigrations:
    _by_dst: dict[InstanceId, list[_Incoming]] = field(default_factory=dict)  # oldest first
    _tokens: itertools.count = field(default_factory=lambda: itertools.count(1))

    def begin(self, dst_id: InstanceId, num_blocks: int, src_id: InstanceId) -> int:
        """A migration from `src_id` into `dst_id` started, expected to take `num_blocks`; its token for `end`."""
        token = next(self._tokens)
        self._by_dst.setdefault(dst_id, []).append(_Incoming(token, max(num_blocks, 0), src_id))
        return token

    def end(self, dst_id: InstanceId, token: int) -> None:
        incoming = [i for i in self._by_dst.get(dst_id, ()) if i.token != token]
        if incoming:
            self._by_dst[dst_id] = incoming
        else:
            self._by_dst.pop(dst_id, None)

    def note_report(self, dst_id: InstanceId, num_shown: int) -> bool:
        """A report of `dst_id` shows `num_shown` migrations in (see the module's doc); whether that showed
        one of ours that was not shown yet."""
        incoming = self._by_dst.get(dst_id, ())
        hidden = [i for i in incoming if not i.is_shown]
        newly_shown = hidden[:max(num_shown - (len(incoming) - len(hidden)), 0)]
        for entry in newly_shown:
            entry.is_shown = True
        return bool(newly_shown)

    def reservation(self, dst_id: InstanceId) -> Reservation:
        """What ours that no report shows yet hold of `dst_id`."""
        hidden = [i for i in self._by_dst.get(dst_id, ()) if not i.is_shown]
        return Reservation(len(hidden), sum(i.num_blocks for i in hidden), num_migrations=len(hidden))

    def held_from(self, dst_id: InstanceId) -> tuple[tuple[InstanceId, int], ...]:
        """Ours into `dst_id` that no report shows yet, each as (its source, its blocks): what `reservation` holds."""
        return tuple((i.src_id, i.num_blocks) for i in self._by_dst.get(dst_id, ()) if not i.is_shown)

    def forget(self, dst_id: InstanceId) -> None:
        """It left: its migrations end with errors (their `end` then finds nothing)."""
        self._by_dst.pop(dst_id, None)
