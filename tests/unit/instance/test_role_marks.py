"""RoleMarks over a stand-in for the registry's etcd calls: a mark that etcd did not take is
written again until it does, the newest role winning (found by review: it was tried once)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.registry import ROLE_MARKS
from services.instance.config import InstanceRole
from services.instance.role_marks import RoleMarks

pytestmark = pytest.mark.timeout(20)

BOTH, PREFILL, DECODE = InstanceRole.BOTH, InstanceRole.PREFILL, InstanceRole.DECODE
KEY = f"{ROLE_MARKS}/i-0"


class FlakyEtcd:
    """The Registry calls RoleMarks makes, over a dict; `is_away` makes every call time out."""

    def __init__(self) -> None:
        self.marks: dict = {}
        self.is_away = False

    def _check(self) -> None:
        if self.is_away:
            raise TimeoutError("etcd away")  # one of ETCD_ERRORS

    async def get_json(self, key):
        self._check()
        return self.marks.get(key)

    async def put_json(self, key, value):
        self._check()
        self.marks[key] = value

    async def delete_json_if(self, key, condition):
        self._check()
        return self.marks.pop(key, None) is not None


async def settled(marks: RoleMarks, etcd: FlakyEtcd, expected) -> None:
    for _ in range(100):
        if (etcd.marks.get(KEY) or {}).get("role") == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"mark {etcd.marks.get(KEY)}, expected role {expected}")


@pytest.fixture
async def writer():
    etcd = FlakyEtcd()
    marks = RoleMarks(etcd, "i-0", BOTH)
    loop = asyncio.create_task(marks.write_loop())
    yield marks, etcd
    loop.cancel()


async def test_a_mark_etcd_did_not_take_is_written_once_it_answers(writer):
    marks, etcd = writer
    etcd.is_away = True
    await marks.keep(PREFILL)  # the role changes here all the same
    assert KEY not in etcd.marks
    etcd.is_away = False
    await settled(marks, etcd, "prefill")
    assert await RoleMarks(etcd, "i-0", BOTH).restored_role() is PREFILL  # a restart after that


async def test_the_newest_role_wins_and_setting_it_back_removes_the_mark(writer):
    marks, etcd = writer
    await marks.keep(PREFILL)
    etcd.is_away = True
    await marks.keep(DECODE)
    await marks.keep(BOTH)  # back to the command line's while etcd is away
    etcd.is_away = False
    await settled(marks, etcd, None)
    assert await RoleMarks(etcd, "i-0", BOTH).restored_role() is BOTH


async def test_a_changed_command_line_wins_over_the_mark(writer):
    marks, etcd = writer
    await marks.keep(PREFILL)
    assert await RoleMarks(etcd, "i-0", DECODE).restored_role() is DECODE
    assert KEY not in etcd.marks


async def test_a_mark_unread_at_start_follows_the_role_the_instance_runs_with(writer):
    """A restart that cannot read the mark (etcd flaked) runs with its --role. Before, the mark stayed:
    it named a role the instance did not have (the launcher's banner listed it as set at runtime), and
    the next restart took that stale role back."""
    marks, etcd = writer
    await marks.keep(PREFILL)
    etcd.is_away = True
    restarted = RoleMarks(etcd, "i-0", BOTH)
    loop = asyncio.create_task(restarted.write_loop())
    assert await restarted.restored_role() is BOTH
    etcd.is_away = False
    await settled(restarted, etcd, None)
    assert await RoleMarks(etcd, "i-0", BOTH).restored_role() is BOTH  # the next restart: the role it ran with
    loop.cancel()


async def test_a_set_role_before_an_unread_start_keeps_its_mark(writer):
    marks, etcd = writer
    etcd.is_away = True
    await marks.keep(DECODE)  # a SetRole while the instance starts (it wins over the stored role)
    assert await marks.restored_role() is BOTH
    etcd.is_away = False
    await settled(marks, etcd, "decode")
