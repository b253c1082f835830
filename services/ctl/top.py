"""`ferryctl top`: the cluster's instances, load and latest migrations, redrawn every
--interval seconds (migrations only where the managers serve ListMigrations).

On a terminal each frame replaces the last (ANSI clear); piped, frames follow one
another (with --json, one JSON object per line), so `top --iterations 1` is a snapshot.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TextIO

from services.common.errors import FerryError
from services.ctl.client import AdminClient, NotAvailableYet
from services.ctl.records import ClusterStatus, InstanceRow, MigrationRow, to_json
from services.ctl.tables import load_table, migrations_table, view_note

_CLEAR = "\x1b[H\x1b[2J"
NUM_MIGRATIONS_SHOWN = 8


@dataclass(slots=True)
class CounterRate:
    """A counter's rate per second per instance (requests served, preemptions), from its change between frames."""

    counter: Callable[[InstanceRow], int]
    _last: dict[str, tuple[float, int]] = field(default_factory=dict)

    def update(self, rows: list[InstanceRow], now: float) -> dict[str, float]:
        rates = {}
        for row in rows:
            if not row.has_report:  # its count reads 0 until the (new) leader hears from it
                continue
            before, count = self._last.get(row.instance_id), self.counter(row)
            if before is not None and now > before[0]:
                rates[row.instance_id] = max(0, count - before[1]) / (now - before[0])  # restarted: not negative
            self._last[row.instance_id] = (now, count)
        return rates


SERVED, PREEMPTED = attrgetter("num_requests_served"), attrgetter("num_preemptions")


@dataclass(slots=True)
class Rates:
    """The rates `top` shows: requests served and preemptions (KV pressure) per second."""

    served: CounterRate = field(default_factory=lambda: CounterRate(SERVED))
    preempted: CounterRate = field(default_factory=lambda: CounterRate(PREEMPTED))


async def run_top(client: AdminClient, interval_s: float, iterations: int, as_json: bool,
                  out: TextIO = sys.stdout) -> bool:
    """Draw `iterations` frames (0 = until interrupted); a failed poll is shown, not fatal. True if the
    last frame was drawn from the manager's answer (a snapshot that failed exits non-zero)."""
    rates = Rates()
    is_tty = out.isatty() and not as_json
    frame, is_answered = 0, False
    while iterations == 0 or frame < iterations:
        if frame:
            await asyncio.sleep(interval_s)
        frame += 1
        text, is_answered = await _frame(client, rates, as_json)
        out.write((_CLEAR if is_tty else "") + text + "\n")
        out.flush()
    return is_answered


async def _frame(client: AdminClient, rates: Rates, as_json: bool) -> tuple[str, bool]:
    try:
        status, rows, migrations = await asyncio.gather(client.cluster_status(), client.list_instances(),
                                                        _recent_migrations(client))
    except FerryError as exc:
        text = json.dumps({"error": exc.message}) if as_json else f"{_clock()}  admin {client.address}: {exc.message}"
        return text, False
    now = time.monotonic()
    served_per_s, preempted_per_s = rates.served.update(rows, now), rates.preempted.update(rows, now)
    if as_json:
        return json.dumps({"time": time.time(), "status": to_json(status), "instances": to_json(rows),
                           "served_per_s": served_per_s, "preempted_per_s": preempted_per_s,
                           "migrations": None if migrations is None else to_json(migrations)}), True
    lines = [*_header(client.address, status), "", load_table(rows, served_per_s, preempted_per_s)]
    if migrations is not None:
        lines += ["", f"latest migrations (newest last, up to {NUM_MIGRATIONS_SHOWN})", migrations_table(migrations)]
    return "\n".join(lines), True


async def _recent_migrations(client: AdminClient) -> list[MigrationRow] | None:
    """The newest few, or None while the managers do not serve ListMigrations."""
    try:
        return (await client.list_migrations())[-NUM_MIGRATIONS_SHOWN:]
    except NotAvailableYet:
        return None


def _header(address: str, status: ClusterStatus) -> list[str]:
    """Which manager answered (a standby answering alone, or any manager while none leads, has no load reports:
    its view shows serving instances as unhealthy, and a line under the header says so, as `instances` does)."""
    leader = f"{status.leader_id} ({status.leader_address})" if status.leader_id else "none elected"
    answered_by = f"  answered by {status.answered_by}" if status.answered_by else ""  # an older manager does not say
    return [f"ferry top  {_clock()}  admin {address}{answered_by}  leader {leader}  policy {status.dispatch_policy}",
            f"instances {status.num_instances}: {status.num_serving} serving, {status.num_draining} draining, "
            f"{status.num_unhealthy} unhealthy   requests: {status.num_running} running, {status.num_waiting} waiting   "
            f"dispatched {status.num_dispatched}   average freeness {status.average_freeness:.1f}",
            *([] if status.is_leaders_view else [view_note(status)])]


def _clock() -> str:
    return time.strftime("%H:%M:%S")
