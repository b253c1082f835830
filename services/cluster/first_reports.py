"""`ready` means ready to dispatch: the leader holds a load report of every instance the launcher started.

An instance passes its health check just before its first load report reaches the leader, and until then
the dispatcher passed it over while another instance had reported (services/manager/dispatcher.py
`_reported_first`: after a takeover, a dead instance whose key outlives it must not draw dispatches). So a
burst sent right at `ready` went to whichever instance reported first. The leader now takes one registered
during its term as idle until it reports; this wait still covers an instance that registered before (a
standby that took over meanwhile), and `ready` still means every load is known. Bounded: after
FIRST_REPORTS_TIMEOUT_S the launcher goes on and names the instances still silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection
from typing import Protocol

from services.common.errors import FerryError
from services.common.gen.ferry.v1 import manager_pb2

FIRST_REPORTS_TIMEOUT_S = 10.0
POLL_S = 0.05


class InstanceLister(Protocol):
    async def list_instances(self) -> list[manager_pb2.InstanceInfo]: ...


async def wait_for_first_reports(manager: InstanceLister, instance_ids: Collection[str],
                                 timeout_s: float = FIRST_REPORTS_TIMEOUT_S) -> set[str]:
    """Wait until `manager` holds a load report of each of `instance_ids`; those still without one at the
    deadline (empty: every one reported). A manager that does not answer yet is asked again."""
    deadline = time.monotonic() + timeout_s
    silent = set(instance_ids)
    while True:
        with contextlib.suppress(FerryError):
            reported = {i.instance_id for i in await manager.list_instances() if i.report_age_s >= 0}
            silent = set(instance_ids) - reported
        if not silent or time.monotonic() >= deadline:
            return silent
        await asyncio.sleep(POLL_S)
