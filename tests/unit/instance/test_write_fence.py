"""A revoke the transfer service does not answer is retried each sweep: warned about once, then quiet."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import structlog

from services.common.errors import Unavailable
from services.instance.write_fence import TransferWriteFence

pytestmark = pytest.mark.timeout(30)


@dataclass
class DownThenUpClient:
    """A transfer service that is down for the first `down_for` calls."""

    down_for: int
    address: str = "127.0.0.1:1"
    calls: int = 0

    async def revoke_writes(self, instance_id: str, write_grant: int, timeout_s: float | None = None) -> bool:
        self.calls += 1
        if self.calls <= self.down_for:
            raise Unavailable("connection refused")
        return True


async def test_unanswered_revoke_warns_once_per_grant_and_logs_its_confirmation():
    fence = TransferWriteFence(DownThenUpClient(down_for=4), "instance-0")
    with structlog.testing.capture_logs() as logs:
        answers = [await fence.revoke(7) for _ in range(3)] + [await fence.revoke(8)] + [await fence.revoke(7)]
        answers.append(await fence.revoke(9))  # a first-time success says nothing
    assert answers == [False, False, False, False, True, True]
    levels = [(entry["event"], entry["write_grant"], entry["log_level"]) for entry in logs]
    assert levels == [
        ("write_grant_revoke_unconfirmed", 7, "warning"),
        ("write_grant_revoke_unconfirmed", 7, "debug"),
        ("write_grant_revoke_unconfirmed", 7, "debug"),
        ("write_grant_revoke_unconfirmed", 8, "warning"),
        ("write_grant_revoke_confirmed", 7, "info"),
    ]
