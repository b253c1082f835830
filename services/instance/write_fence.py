"""The destination's fence against late KV writes: write grants on its own transfer service.

Every incoming migration gets a fresh grant before its block ids leave this instance, and
its blocks go back to the pool only after the transfer service confirmed the revoke (no
write under the grant is under way, and none can start). Only that service writes into
this instance's KV (it receives the grpc and gloo streams, and makes the shared-memory
copies), and only one process can serve its port, so its answer settles it: a frozen
service does not answer, and the blocks wait (services/transfer/write_grants.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from services.common.errors import FerryError
from services.transfer.client import TransferClient

log = structlog.get_logger(__name__)

FENCE_RPC_TIMEOUT_S = 2.0


class WriteFence(Protocol):
    def new_grant_id(self) -> int: ...

    async def grant(self, grant_id: int) -> None:
        """Open writes under `grant_id`; raises (FerryError) if the transfer service did not take it."""

    async def revoke(self, grant_id: int) -> bool:
        """True once no write under `grant_id` can land any more; False if that is not known yet."""


@dataclass(frozen=True, slots=True)
class TransferWriteFence:
    client: TransferClient
    instance_id: str
    timeout_s: float = FENCE_RPC_TIMEOUT_S

    def new_grant_id(self) -> int:
        return secrets.randbelow(2**64 - 1) + 1  # never 0 (unfenced), never reused in practice

    async def grant(self, grant_id: int) -> None:
        await self.client.grant_writes(self.instance_id, grant_id, self.timeout_s)

    _unconfirmed: set[int] = field(default_factory=set, compare=False, repr=False)  # grants whose revoke failed

    async def revoke(self, grant_id: int) -> bool:
        """A failed revoke is logged as a warning once per grant (the sweeps retry it every second
        while the transfer service is down), then at debug; its confirmation is logged again."""
        try:
            await self.client.revoke_writes(self.instance_id, grant_id, self.timeout_s)
        except FerryError as exc:
            retried = grant_id in self._unconfirmed
            self._unconfirmed.add(grant_id)
            (log.debug if retried else log.warning)(
                "write_grant_revoke_unconfirmed", write_grant=grant_id, transfer_address=self.client.address,
                reason=exc.message, code=exc.grpc_code.name)
            return False
        if grant_id in self._unconfirmed:
            self._unconfirmed.discard(grant_id)
            log.info("write_grant_revoke_confirmed", write_grant=grant_id, transfer_address=self.client.address)
        return True


class NoWriteFence:
    """Without a transfer service nothing writes into this instance's KV."""

    def new_grant_id(self) -> int:
        return 0

    async def grant(self, grant_id: int) -> None:
        return None

    async def revoke(self, grant_id: int) -> bool:
        return True
