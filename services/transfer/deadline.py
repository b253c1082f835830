"""A monotonic deadline shared by every stage of one transfer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.errors import Unavailable


@dataclass(frozen=True, slots=True)
class Deadline:
    expires_at: float  # time.monotonic()

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        return cls(time.monotonic() + timeout_s)

    def remaining_s(self) -> float:
        """Seconds left; raises Unavailable once the deadline has passed."""
        left = self.expires_at - time.monotonic()
        if left <= 0:
            raise Unavailable("transfer deadline exceeded; the peer is too slow or gone (raise --transfer-timeout-s "
                              "for very large transfers)")
        return left
