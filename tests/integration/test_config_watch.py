"""The managers' watch of config/ (policy, drain marks) against a real etcd that compacts its history."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.etcd_client import connect_etcd
from services.common.etcd_launcher import LocalEtcd
from services.manager.config_store import ConfigStore

pytestmark = pytest.mark.timeout(90)


async def _until(condition, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.1)


async def test_a_change_after_an_etcd_restart_past_the_compacted_history_is_applied(tmp_path):
    """etcd compacts an hour of history away; after a restart the watch resumes from a revision that is
    gone and is cancelled. Before, the loop took that for "no change" and never applied another one."""
    etcd = await LocalEtcd(data_dir=tmp_path / "data", log_dir=tmp_path / "logs").start_async()
    client = await connect_etcd([etcd.endpoint])
    applied = []
    watch = asyncio.create_task(ConfigStore(client, "c1", "m1").watch_loop(applied.append))
    try:
        await _until(lambda: applied, 10)
        for i in range(20):  # other keys move the revision on (load records, migration history)
            await client.kv.put(f"/ferry/c1/other/{i}", "x")
        await client.kv.compact((await client.kv.get("/ferry/c1/other/19")).header.revision)
        await asyncio.to_thread(etcd.restart)  # the client's watch reconnects by itself
        await asyncio.sleep(2.0)
        await client.kv.put("/ferry/c1/config/policy", json.dumps({"dispatch": "flood"}))
        await _until(lambda: len(applied) > 1 and applied[-1].dispatch_policy == "flood", 20)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        etcd.stop()
