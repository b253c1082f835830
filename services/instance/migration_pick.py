"""Which request a migration out moves, and the claim on it that keeps every other migration from
suspending it until that migration ends (MigrationDriver)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services.common.errors import Aborted, FailedPrecondition
from services.instance.engine.migration_state import HeldRequest
from services.instance.migration_domain import MigrateOutPlan

if TYPE_CHECKING:
    from services.instance.request_stream import RequestStream
    from services.instance.runner import EngineRunner

# How long MigrateOut of a request that migrated in waits for its client to follow it here (normally
# milliseconds): until then the client knows it elsewhere and would miss a second hand-off.
CLIENT_ATTACH_WAIT_S = 2.0


class MigrationPicker:
    """Picks the request each migration out moves and holds the claims on them (`moving`)."""

    def __init__(self, runner: EngineRunner, instance_id: str) -> None:
        self._runner = runner
        self._instance_id = instance_id
        # Request ids migrating out now, each with the copy its migration moves (its stream when claimed): a copy that
        # took the id since (a resume of the request here) is not that migration's.
        self.moving: dict[str, RequestStream | None] = {}

    async def pick(self, plan: MigrateOutPlan, copy: RequestStream | None = None
                   ) -> tuple[str, HeldRequest | None, RequestStream | None]:
        """The request to move, claimed (in `moving`, until `release`) before any await that could let a
        second migration claim it too; `plan.held` if the request is still parked as it says; and the stream of
        the copy picked (`copy` if given: Aborted if another copy runs under the id now)."""
        if plan.request_id:
            stream = self._claim(plan.request_id)
            try:
                if copy is not None and stream is not copy:
                    raise Aborted(f"request {plan.request_id} was aborted (maybe resumed here as another copy) "
                                  "before its migration began; nothing left to move")
                await self._wait_for_client(plan.request_id, stream)
                held = await self._runner.call(lambda: self._check_movable(plan))
            except BaseException:
                self.release(plan.request_id)
                raise
            return plan.request_id, held, stream
        exclude = frozenset(self.moving) | plan.exclude_request_ids | self._runner.unattached_request_ids()
        request_id = await self._runner.call(
            lambda: self._runner.engine.pick_for_migration(plan.selection, exclude, plan.dst_max_model_len))
        if request_id is None:
            fitting = (f", none that fits the destination's max_model_len of {plan.dst_max_model_len} tokens "
                       "(prompt + max_tokens)" if plan.dst_max_model_len else "")
            raise FailedPrecondition(f"instance {self._instance_id} has no request to migrate "
                                     f"(none decoding or waiting{fitting}); try again once it has")
        if request_id in self.moving:  # another migration picked it while we asked: it alone may suspend it
            raise Aborted(f"request {request_id} was picked by another migration meanwhile; try again")
        return request_id, None, self._claim(request_id)

    def release(self, request_id: str) -> None:
        """Its migration ended."""
        self.moving.pop(request_id, None)

    def _check_movable(self, plan: MigrateOutPlan) -> HeldRequest | None:
        """On the engine thread: NotFound or FailedPrecondition if the request cannot move; `plan.held` if it
        is still parked as then. Another migration that failed meanwhile may have resumed it, and it decoded on
        (its PD hand-off had taken the parked state before): that state is stale, it is suspended afresh."""
        engine = self._runner.engine
        engine.check_movable(plan.request_id)
        if plan.held is None or engine.migration_blocks(plan.request_id) != plan.held.blocks:
            return None
        return plan.held

    def _claim(self, request_id: str) -> RequestStream | None:
        """Claim the copy that owns `request_id` now; its stream."""
        if request_id in self.moving:
            raise FailedPrecondition(f"request {request_id} is already migrating; wait for it to end")
        stream = self.moving[request_id] = self._runner.stream(request_id)
        return stream

    async def _wait_for_client(self, request_id: str, stream: RequestStream | None) -> None:
        """A request that migrated in moves on only once its client attached here (it would follow
        a hand-off it never read to the wrong instance, and have to resume). Aborted if that copy is
        dropped or replaced meanwhile (a resume of the same request here): what the caller saved of
        it (a PD hand-off's parked state) would move blocks that are no longer its."""
        deadline = time.monotonic() + CLIENT_ATTACH_WAIT_S
        while stream is not None and not stream.is_attached:
            if self._runner.stream(request_id) is not stream:
                raise Aborted(f"request {request_id} was dropped or replaced here while its migration waited "
                              "for its client; nothing left to move")
            if time.monotonic() >= deadline:
                raise FailedPrecondition(f"request {request_id} migrated here moments ago and its client has not "
                                         f"followed it after {CLIENT_ATTACH_WAIT_S:g} s; try again later")
            await asyncio.sleep(0.02)
