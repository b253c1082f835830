"""The etcd token refresh loop outlives any error from one authentication."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from etcd3aio import EtcdError

from services.common.etcd_client import EtcdAccess, _token_refresh_loop
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(10)


class FakeEtcd:
    """Authenticates with the scripted answers (or errors), in turn."""

    def __init__(self, *answers: BaseException | str) -> None:
        self.answers = list(answers)
        self.auth = SimpleNamespace(authenticate=self._authenticate)
        self.token: str | None = None

    async def _authenticate(self, user, password, timeout=None):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return SimpleNamespace(token=answer)

    def set_token(self, token: str) -> None:
        self.token = token


async def test_unexpected_errors_do_not_end_the_token_refresh():
    etcd = FakeEtcd(EtcdError("refused"), RuntimeError("not connected"), "token-2")
    loop = asyncio.create_task(_token_refresh_loop(etcd, EtcdAccess(user="u", password="p"), interval_s=0.01))
    await until(lambda: etcd.token == "token-2", loop)
    await assert_cancels(loop)
