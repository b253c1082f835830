"""The launcher says `ready` once the leader can dispatch to every instance: it holds a load report of each
(an instance in its first grace is passed over while another has reported)."""

from __future__ import annotations

import pytest

from services.cluster.first_reports import wait_for_first_reports
from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import manager_pb2

pytestmark = pytest.mark.timeout(10)


class ScriptedManager:
    """ListInstances answers in turn (an exception is raised); the last answer repeats."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.num_calls = 0

    async def list_instances(self) -> list[manager_pb2.InstanceInfo]:
        self.num_calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return [manager_pb2.InstanceInfo(instance_id=i, report_age_s=age) for i, age in answer.items()]


async def test_it_waits_until_every_instance_has_reported_asking_again_while_the_manager_does_not_answer():
    manager = ScriptedManager(Unavailable("not serving yet"), {"instance-0": 0.01, "instance-1": -1.0},
                              {"instance-0": 0.05, "instance-1": 0.02})
    assert await wait_for_first_reports(manager, ["instance-0", "instance-1"], timeout_s=5) == set()
    assert manager.num_calls == 3


async def test_an_instance_missing_from_the_list_counts_as_silent():
    manager = ScriptedManager({"instance-0": 0.01}, {"instance-0": 0.01, "instance-1": 0.01})
    assert await wait_for_first_reports(manager, ["instance-0", "instance-1"], timeout_s=5) == set()
    assert manager.num_calls == 2


async def test_past_its_deadline_it_names_the_instances_still_silent():
    manager = ScriptedManager({"instance-0": 0.01, "instance-1": -1.0, "instance-2": -1.0})
    silent = await wait_for_first_reports(manager, ["instance-0", "instance-1", "instance-2"], timeout_s=0.2)
    assert silent == {"instance-1", "instance-2"}
