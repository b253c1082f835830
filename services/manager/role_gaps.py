"""Prefill/decode disaggregation with a role missing: which role is missing now, logged once per
gap, counted per request that had to do without it (README "Prefill/decode disaggregation").

* no PREFILL (or BOTH) instance serves: new requests go to DECODE instances, which prefill them;
* no DECODE instance serves: prefilled requests keep decoding on their prefill instance.

`is_missing` is what ferry_manager_pd_role_missing reads (metrics.RoleGapCollector, on the leader
only). A gap closes (healed) the first time an instance of the role is found again; the manager's
migration loop then moves the requests that decoded on prefill instances meanwhile.
"""

from __future__ import annotations

import structlog

from services.manager import metrics
from services.manager.domain import Role

log = structlog.get_logger(__name__)


class RoleGaps:
    def __init__(self) -> None:
        self._missing: set[Role] = set()

    def is_missing(self, role: Role) -> bool:
        return role in self._missing

    def note_missing(self, role: Role, request_id: str) -> None:
        """A request had to do without `role` (logged when the gap opens, counted every time)."""
        metrics.PD_ROLE_FALLBACKS.labels(role.value).inc()
        if role in self._missing:
            return
        self._missing.add(role)
        log.warning("pd_role_missing", role=role.value, request_id=request_id,
                    action=_ACTIONS[role])

    def note_present(self, role: Role) -> None:
        if role not in self._missing:
            return
        self._missing.discard(role)
        log.info("pd_role_restored", role=role.value)


_ACTIONS = {
    Role.PREFILL: "new requests prefill on decode instances until a prefill instance serves",
    Role.DECODE: "prefilled requests keep decoding on their prefill instance until a decode instance serves",
}
