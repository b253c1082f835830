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
    assert await marks.restored_role() is DECODE  # the role it runs with (etcd was not read)
    etcd.is_away = False
    await settled(marks, etcd, "decode")


class StartingEtcd(FlakyEtcd):
    """Also the instance-record calls app.register_with_role and role_writer make."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict] = {}

    async def register(self, kind, member_id, value):
        self._check()
        self.records[member_id] = value

    def holds(self, kind, member_id) -> bool:
        return member_id in self.records

    async def update(self, kind, member_id, value):
        self._check()
        self.records[member_id] = value


async def start_after_a_set_role(command_line_role: InstanceRole, stored: dict, set_to: InstanceRole):
    """An instance restarting with `command_line_role` and the mark `stored`, that gets SetRole(`set_to`) while
    etcd is still away at its start (the manager still holds its old record), then registers."""
    from services.common.gen.ferry.v1 import common_pb2, instance_pb2
    from services.instance import app
    from services.instance.convert import role_to_proto
    from services.instance.server import InstanceIdentity, InstanceServicer

    etcd = StartingEtcd()
    etcd.marks[KEY] = stored
    marks = RoleMarks(etcd, "i-0", command_line_role)
    servicer = InstanceServicer(runner=None)
    servicer.identity = InstanceIdentity("i-0", "127.0.0.1:2", command_line_role, "m", 1024, common_pb2.KvGeometry())
    record = lambda identity: {"role": identity.role.value}  # noqa: E731
    servicer.on_role_change = app.role_writer(etcd, marks, record)
    etcd.is_away = True
    await servicer.SetRole(instance_pb2.SetRoleRequest(role=role_to_proto(set_to)), None)  # its mark waits
    etcd.is_away = False
    await app.register_with_role(etcd, marks, servicer, command_line_role, record)
    loop = asyncio.create_task(marks.write_loop())
    return servicer, marks, etcd, loop


async def test_a_set_role_back_to_the_command_line_role_before_registering_wins_over_the_stored_mark():
    """Before, the stored decode came back at registration (the instance ran decode, the SetRole had answered
    both, and its mark's removal followed): app.py took a role equal to the command line's for no SetRole."""
    servicer, marks, etcd, loop = await start_after_a_set_role(
        BOTH, {"instance_id": "i-0", "role": "decode", "command_line_role": "both"}, BOTH)
    assert servicer.identity.role is BOTH and etcd.records["i-0"] == {"role": "both"}
    await settled(marks, etcd, None)
    loop.cancel()


async def test_a_set_role_before_registering_keeps_its_mark_over_one_set_over_another_command_line():
    """Before, the start dropped the stale mark by keeping the command line's role, which replaced the SetRole's
    mark still to be written: the instance ran decode with no mark, and its next restart came back both."""
    servicer, marks, etcd, loop = await start_after_a_set_role(
        BOTH, {"instance_id": "i-0", "role": "prefill", "command_line_role": "prefill"}, DECODE)
    assert servicer.identity.role is DECODE and etcd.records["i-0"] == {"role": "decode"}
    await settled(marks, etcd, "decode")
    loop.cancel()
