"""Write grants: the fence that keeps a late copy out of KV blocks an instance gave away.

A destination instance grants writes for one incoming migration (GrantWrites) before it
hands out the reserved block ids, and revokes the grant (RevokeWrites) before it gives
those blocks to anything else. Every write into a mapped instance's KV memory (a grpc or
gloo receive, a shared-memory copy) names its grant and holds it for as long as it may
write: a write under an unknown or revoked grant is refused before it touches a byte, a
write under way stops at its next chunk once its grant is revoked, and `revoke` answers
only once no write holds the grant any more. So when RevokeWrites returns, nothing can
land in those blocks later, however long this process was frozen meanwhile; when it
does not return, the instance keeps the blocks out of use and asks again.

Grant 0 is "unfenced": tools and benchmarks that call Transfer with raw block ids. Once an
instance has opened a grant it is fenced: an unfenced write into it is refused too.
The table is bounded: past MAX_GRANTS the oldest idle grant is dropped, which only
refuses its later writes (its migration fails and is retried), never lets one through.
Revoked ids (also ones revoked before their GrantWrites arrived, which a frozen service
can see reordered) are remembered, the last MAX_GRANTS of them: a late GrantWrites never
opens them again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from services.common.errors import Aborted, FailedPrecondition, InvalidArgument
from services.transfer.domain import InstanceId

log = structlog.get_logger(__name__)

UNFENCED = 0
MAX_GRANTS = 4096
MAX_GRANT_ID = 2**64 - 1


@dataclass(slots=True)
class WriteGrant:
    instance_id: InstanceId
    grant_id: int
    refusal: str = ""  # why no write may start under it (not granted here, revoked, ...); "" = open
    is_revoked: bool = False
    num_writers: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no write holds it

    def __post_init__(self) -> None:
        self.idle.set()

    def check(self) -> None:
        """Raise unless writes may go on: every writer calls it before it writes, and before each chunk."""
        if self.refusal:
            raise FailedPrecondition(self.refusal)
        if self.is_revoked:
            raise Aborted(f"write grant {self.grant_id} of instance {self.instance_id!r} was revoked while blocks "
                          "were arriving: the destination gave up this migration's reservation")


class WriteGrants:
    """The live grants of every instance this service maps, by (instance id, grant id)."""

    def __init__(self, max_grants: int = MAX_GRANTS) -> None:
        self._grants: OrderedDict[tuple[InstanceId, int], WriteGrant] = OrderedDict()
        self._max_grants = max_grants
        self._fenced: set[InstanceId] = set()  # instances that opened a grant: every write must name one
        self._revoked: OrderedDict[tuple[InstanceId, int], None] = OrderedDict()  # never to open again

    def __len__(self) -> int:
        return sum(not grant.is_revoked for grant in self._grants.values())

    def grant(self, instance_id: InstanceId, grant_id: int) -> None:
        _check_id(grant_id)
        key = (instance_id, grant_id)
        if key in self._revoked or (key in self._grants and self._grants[key].is_revoked):
            raise FailedPrecondition(f"write_grant: {grant_id} of instance {instance_id!r} was revoked; "
                                     "a revoked grant never opens again, use a new id")
        if key in self._grants:
            return  # granted already: idempotent
        self._evict_idle()
        self._grants[key] = WriteGrant(instance_id, grant_id)
        self._fenced.add(instance_id)

    async def revoke(self, instance_id: InstanceId, grant_id: int) -> bool:
        """Refuse the grant's writes from now on and wait until none is under way. False if it was
        unknown (never granted here, or revoked and idle already), which is as safe."""
        _check_id(grant_id)
        self._remember_revoked((instance_id, grant_id))
        grant = self._grants.get((instance_id, grant_id))
        if grant is None:
            return False
        grant.is_revoked = True
        await grant.idle.wait()  # bounded by the caller's deadline
        self._grants.pop((instance_id, grant_id), None)
        return True

    def revoke_all(self, instance_id: InstanceId) -> int:
        """The instance's KV memory went away or was replaced (unmapped, or mapped again by a restarted
        instance under the same id): no grant of the old mapping may write into the new one. Writers
        under way keep writing into the old mapping's memory (they hold its view) and are refused from
        their next chunk on. Returns how many grants were open."""
        keys = [key for key in self._grants if key[0] == instance_id]
        num_open = 0
        for key in keys:
            self._remember_revoked(key)
            grant = self._grants[key]
            num_open += not grant.is_revoked
            grant.is_revoked = True
            if grant.num_writers == 0:
                del self._grants[key]
        if num_open:
            log.warning("write_grants_revoked_with_mapping", instance_id=instance_id, num_grants=num_open)
        return num_open

    def unfence(self, instance_id: InstanceId) -> None:
        """The instance is no longer mapped here: whatever maps its id next decides afresh."""
        self._fenced.discard(instance_id)

    @contextlib.asynccontextmanager
    async def writing(self, instance_id: InstanceId, grant_id: int) -> AsyncIterator[WriteGrant]:
        """Hold the grant while writing into `instance_id`'s KV. The writer calls `check()` on it
        before it writes anything (it raises for a grant that is not open) and before each chunk."""
        if grant_id == UNFENCED:
            refusal = "" if instance_id not in self._fenced else (
                f"instance {instance_id!r} fences its KV memory with write grants: name the grant its "
                "PrepareMigrateIn answered (dst_write_grant); nothing was written")
            yield WriteGrant(instance_id, UNFENCED, refusal)
            return
        grant = self._grants.get((instance_id, grant_id))
        if grant is None or grant.is_revoked:
            yield WriteGrant(instance_id, grant_id, f"write grant {grant_id} is not open for instance {instance_id!r} "
                             "on this transfer service: the destination revoked it (it gave up the reservation) or "
                             "granted it elsewhere; nothing was written")
            return
        grant.num_writers += 1
        grant.idle.clear()
        try:
            yield grant
        finally:
            grant.num_writers -= 1
            if grant.num_writers == 0:
                grant.idle.set()
                if grant.is_revoked:
                    self._grants.pop((instance_id, grant_id), None)

    def _remember_revoked(self, key: tuple[InstanceId, int]) -> None:
        self._revoked[key] = None
        self._revoked.move_to_end(key)
        while len(self._revoked) > self._max_grants:
            self._revoked.popitem(last=False)

    def _evict_idle(self) -> None:
        while len(self._grants) >= self._max_grants:
            idle = next((key for key, grant in self._grants.items() if grant.num_writers == 0), None)
            if idle is None:
                raise FailedPrecondition(f"{len(self._grants)} write grants hold writes under way on this transfer "
                                         "service; retry once some finish")
            del self._grants[idle]
            log.warning("write_grant_evicted", instance_id=idle[0], write_grant=idle[1], max_grants=self._max_grants)


def _check_id(grant_id: int) -> None:
    if not 0 < grant_id <= MAX_GRANT_ID:
        raise InvalidArgument(f"write_grant: must be 1..2^64-1, got {grant_id}")
