"""The managers' watch of config/ (policy, drain marks) against a real etcd that compacts its history."""

from __future__ import annotations

import asyncio
import json
import shutil

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
        await etcd.restart_async()  # the client's watch reconnects by itself
        await asyncio.sleep(2.0)
        await client.kv.put("/ferry/c1/config/policy", json.dumps({"dispatch": "flood"}))
        await _until(lambda: len(applied) > 1 and applied[-1].dispatch_policy == "flood", 20)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        etcd.stop()


async def test_a_change_after_an_etcd_restart_without_its_data_is_applied(tmp_path):
    """etcd lost its data (a wiped volume) and starts over at revision 1; the client's watch reconnects by itself
    and waits for the old revision to come round again. Before, no change was applied until then."""
    etcd = await LocalEtcd(data_dir=tmp_path / "data", log_dir=tmp_path / "logs").start_async()
    client = await connect_etcd([etcd.endpoint])
    for i in range(50):  # other keys move the revision on (load records, migration history)
        await client.kv.put(f"/ferry/c1/other/{i}", "x")
    applied = []
    watch = asyncio.create_task(ConfigStore(client, "c1", "m1").watch_loop(applied.append))
    try:
        await _until(lambda: applied, 10)
        await asyncio.sleep(0.5)  # watching from revision 52 now
        etcd.terminate()
        shutil.rmtree(tmp_path / "data")
        await etcd.start_async()
        await asyncio.sleep(2.0)  # the watch reconnected meanwhile
        await client.kv.put("/ferry/c1/config/policy", json.dumps({"dispatch": "flood"}))
        await _until(lambda: applied[-1].dispatch_policy == "flood", 10)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        etcd.stop()


async def test_the_watch_reads_everything_again_every_resync_interval(etcd: LocalEtcd, cluster: str):
    """A change no watch event announces (a watch stalled without an error) is applied within the interval."""
    client = await connect_etcd([etcd.endpoint])
    applied = []
    watch = asyncio.create_task(ConfigStore(client, cluster, "m1").watch_loop(applied.append, resync_s=0.5))
    try:
        await _until(lambda: len(applied) >= 3, 5)  # no change at all: read again, and again
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
