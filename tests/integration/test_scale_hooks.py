"""`python -m services.cluster.scale_hooks` against a real etcd: it runs the stop command for each
registered instance the target lists as stoppable, once, and the add command while fewer serve
than the target asks, once per instance that registers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from services.cluster.processes import ROOT
from services.common.registry import Registry

pytestmark = pytest.mark.timeout(60)


async def wait_for_files(directory, names: set[str], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while {p.name for p in directory.iterdir()} != names:
        assert time.monotonic() < deadline, f"{sorted(p.name for p in directory.iterdir())} != {sorted(names)}"
        await asyncio.sleep(0.1)


async def test_hooks_follow_the_target_with_commands(etcd, cluster, tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    hooks = subprocess.Popen(
        [sys.executable, "-m", "services.cluster.scale_hooks", "--etcd-endpoints", etcd.endpoint, "--cluster", cluster,
         "--interval-s", "0.2", "--add-command", f"touch {calls}/add-{{next_index}}-of-{{num_instances}}",
         "--stop-command", f"touch {calls}/stop-{{instance_id}}-{{index}}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp_path / "hooks.log").open("wb"))
    try:
        async with Registry([etcd.endpoint], cluster) as members, Registry([etcd.endpoint], cluster) as writer:
            for instance_id in ("host-0", "host-1"):
                await members.register("instances", instance_id, {"address": "127.0.0.1:1", "role": "both"})
            await writer.put_json("scaling/target", {"num_instances": 3, "draining": [], "stoppable": ["host-1"],
                                                     "manager_id": ""})  # a launcher's own: not followed
            await asyncio.sleep(1.0)
            assert list(calls.iterdir()) == []
            await writer.put_json("scaling/target", {"num_instances": 2, "draining": [], "stoppable": ["host-1"],
                                                     "manager_id": "m-0"})
            await wait_for_files(calls, {"stop-host-1-1", "add-2-of-2"})  # host-0 alone serves: one more
            await asyncio.sleep(1.0)  # neither is run again meanwhile
            assert {p.name for p in calls.iterdir()} == {"stop-host-1-1", "add-2-of-2"}
            await members.register("instances", "host-2", {"address": "127.0.0.1:2", "role": "both"})
            await writer.put_json("scaling/target", {"num_instances": 3, "draining": [], "stoppable": ["host-1"],
                                                     "manager_id": "m-0"})
            await wait_for_files(calls, {"stop-host-1-1", "add-2-of-2", "add-3-of-3"})
    finally:
        hooks.terminate()
        hooks.wait(10)
