"""This manager's id, claimed in etcd: `managers/<id>` under the manager's registry lease, naming its address.

Two managers under one id were both accepted: the default id is `<hostname>-<port>`, so two hosts that share a
hostname (cloned VMs, `localhost`) and the default port gave two managers one id. Then ferryctl took a
standby's answer for the leader's (its `answered_by` equals the `leader_id`), refusals and logs named a leader
two processes answer to, and drain marks and scaling targets named an id that is not one manager's.

What an operator wants is one id per manager, told at startup, as instances and transfer services refuse an id
another live process holds (registry.py). So a manager whose id is held by a live manager at another address
refuses to start: `startup_failed` naming that address and `--manager-id`, exit 1 (no `ready` line). Picking a
unique id instead would make ids that change across restarts and that nobody chose, where the operator's
instances, whose default ids clash the same way, fail anyway. A restart at the same address takes its
predecessor's record over at once; one at another address (a host moved after a crash) waits for the old
lease to run out (its TTL), then starts.

Managers need no etcd to start (they wait as standbys): where etcd does not answer at startup the claim is
retried in the background, and the manager campaigns only once it holds its id.
"""

from __future__ import annotations

import os
import socket

import structlog

from services.common.backoff import Backoff
from services.common.errors import FailedPrecondition, Unavailable
from services.common.registry import Registry
from services.common.startup import StartupError

log = structlog.get_logger(__name__)

MANAGERS = "managers"  # `managers/<id>`: {"manager_id", "address", "host", "pid"} under the manager's lease


class ManagerIdClaim:
    def __init__(self, registry: Registry, manager_id: str, address: str, is_default_id: bool) -> None:
        self._registry = registry
        self._manager_id = manager_id
        self._address = address
        self._is_default_id = is_default_id  # no --manager-id: <hostname>-<port>
        self.is_claimed = False

    async def claim(self) -> bool:
        """Register `managers/<id>`: True once held, False while etcd does not answer. StartupError when another
        live manager holds the id (after waiting up to that one's lease TTL, in case it just stopped)."""
        try:
            await self._registry.register(MANAGERS, self._manager_id, self._record())
        except FailedPrecondition as exc:
            raise StartupError(self._clash_text(exc.message)) from None
        except Unavailable as exc:
            log.warning("manager_id_not_claimed", manager_id=self._manager_id, error=exc.message,
                        action="serving as a standby; claiming it again before campaigning")
            return False
        self.is_claimed = True
        log.info("manager_id_claimed", manager_id=self._manager_id, address=self._address)
        return True

    async def claim_loop(self) -> None:
        """Until the id is held (etcd did not answer at startup), with backoff; StartupError on a clash."""
        backoff = Backoff(initial_s=0.5, max_s=5.0)
        while not self.is_claimed and not await self.claim():
            await backoff.sleep()

    def _record(self) -> dict:
        return {"manager_id": self._manager_id, "address": self._address, "host": socket.gethostname(),
                "pid": os.getpid()}

    def _clash_text(self, held: str) -> str:
        default = (f"; this one's is the default, <hostname>-<port> ({self._manager_id}): do two hosts share a "
                   "hostname?" if self._is_default_id else "")
        return (f"manager id {self._manager_id!r} is taken: {held}. Two managers cannot share an id: start each with "
                f"its own --manager-id (FERRY_MANAGER_MANAGER_ID){default}")
