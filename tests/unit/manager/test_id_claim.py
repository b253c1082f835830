"""ManagerIdClaim: a held id stops the manager naming --manager-id; an etcd that does not answer is tried again."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition, Unavailable
from services.common.startup import StartupError
from services.manager.id_claim import MANAGERS, ManagerIdClaim

pytestmark = pytest.mark.timeout(30)

HELD = ("/ferry/c/managers/host-50051 is registered by another live process (at 10.0.0.7:50051) that keeps renewing "
        "its lease")


class FakeRegistry:
    def __init__(self, *answers: BaseException | None) -> None:
        self.answers = list(answers)
        self.registered: list[tuple[str, str, dict]] = []

    async def register(self, kind: str, member_id: str, value: dict) -> bool:
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer
        self.registered.append((kind, member_id, value))
        return True


async def test_a_default_id_another_live_manager_holds_stops_this_one_naming_the_flag():
    """Two hosts with one hostname start managers with one default id, <hostname>-<port>."""
    claim = ManagerIdClaim(FakeRegistry(FailedPrecondition(HELD)), "host-50051", "10.0.0.8:50051", is_default_id=True)
    with pytest.raises(StartupError, match=r"manager id 'host-50051' is taken: .*at 10.0.0.7:50051.*own --manager-id "
                                           r".*the default, <hostname>-<port> \(host-50051\): do two hosts share"):
        await claim.claim()
    assert not claim.is_claimed


async def test_an_etcd_that_does_not_answer_is_tried_again_until_the_id_is_held(monkeypatch):
    registry = FakeRegistry(Unavailable("etcd down"), Unavailable("etcd down"))
    claim = ManagerIdClaim(registry, "m-1", "10.0.0.8:50051", is_default_id=False)
    monkeypatch.setattr("services.manager.id_claim.Backoff.sleep", _no_sleep)
    assert not await claim.claim()
    await claim.claim_loop()
    assert claim.is_claimed
    ((kind, member_id, record),) = registry.registered
    assert (kind, member_id, record["address"], record["manager_id"]) == (MANAGERS, "m-1", "10.0.0.8:50051", "m-1")


async def _no_sleep(self) -> None:
    pass
