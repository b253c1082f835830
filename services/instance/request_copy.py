"""Which copy of a request an Abort means.

A request id can run on one instance more than once: the frontend resumed it there after its stream
broke (this instance was slow or frozen), or it was handed back here by a migration. An Abort the
frontend sent for the earlier copy cannot be called back, and one taken up late (queued in a frozen
instance's socket, retried past its deadline) must not end the copy that replaced it. So a Generate
carries the frontend's attempt (1, 2, ... per Generate it opens for the request), a migration carries
it to the destination with the owner epoch, and an Abort names the (attempt, epoch) it ends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CopyRef:
    """The copy an Abort ends: the frontend's attempt at the request (0: unknown, any copy) and its epoch."""

    attempt: int = 0
    epoch: int = 0

    def is_older_than(self, attempt: int, epoch: int) -> bool:
        """Whether the copy at (`attempt`, `epoch`) came after this one (both attempts known)."""
        return 0 < self.attempt and 0 < attempt and (self.attempt, self.epoch) < (attempt, epoch)


ANY_COPY = CopyRef()  # an Abort that names no attempt (an older frontend, an operator): whatever copy runs
