"""The outputs of one request on its way to the client that reads it (EngineRunner's table of them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.instance.engine.step_output import StepOutput
from services.instance.handoff import Handoff


@dataclass(slots=True, eq=False)  # one stream is one request's copy: equal only to itself (sets of them)
class RequestStream:
    """The outputs of one request, in order; ends after the output with a finish reason,
    or with a `Handoff` when the request moved to another instance."""

    request_id: str
    outputs: asyncio.Queue[StepOutput | Handoff | BaseException]
    epoch: int = 0  # the request's owner epoch on this instance
    attempt: int = 0  # the frontend's attempt at the request that this copy belongs to (0: unknown; request_copy)
    from_token_index: int = 0  # the first output its client asked for (a resume's tokens, an Attach's index)
    is_finished: bool = False
    is_attached: bool = False  # a client reads it (always for Generate; after Attach for migrated-in requests)
    is_prefilling: bool = False  # prefilled here (Generate) and no output yet: its first output ends the prefill
    has_unread_finish: bool = False  # finished before a client attached: kept until one does (or the watchdog)
    handoff: Handoff | None = None  # queued as its last item (the request moved); read once is_finished
    # The first of the engine thread's publishes that can hold its outputs: set there when its request was
    # admitted. Earlier ones are another request's under the same id (one aborted for a resume of it here).
    first_publish: int | None = None

    def takes(self, publish: int) -> bool:
        """Whether outputs of the engine thread's `publish`-th publish under its id are its request's."""
        return self.first_publish is not None and publish >= self.first_publish

    @property
    def has_unread_handoff(self) -> bool:
        """Handed off, and the hand-off still queued: nobody reading this stream knows where the request went."""
        return self.handoff is not None and not self.is_finished

    async def __aiter__(self) -> AsyncIterator[StepOutput | Handoff]:
        while not self.is_finished:
            item = await self.outputs.get()
            if isinstance(item, BaseException):
                self.is_finished = True
                raise item
            self.is_finished = isinstance(item, Handoff) or item.finish_reason is not None
            yield item
