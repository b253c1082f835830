"""`python -m services.cluster up` never leaves a child behind: a hang-up (closed terminal)
stops every child gracefully, and a launcher killed outright takes every child with it.
A child that dies while the launcher runs starts again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal

import grpc
import openai
import pytest

from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import common_pb2, manager_pb2, manager_pb2_grpc
from services.transfer.client import TransferClient
from tests.e2e.conftest import instances, launched_cluster, model_name, wait_for
from tests.reaper import is_running

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["hangup", "killed"])
async def test_no_child_outlives_the_launcher(tiny_model_dir, tmp_path, sig):
    with launched_cluster(tiny_model_dir, tmp_path / "state", "--instances", "1", "--kv-cache-mib", "16") as cluster:
        pids = [process["pid"] for process in cluster["processes"]]  # etcd, manager, transfer, instance, frontend
        assert len(pids) == 5 and all(is_running(pid) for pid in pids)
        try:
            os.kill(cluster["launcher_pid"], sig)

            async def gone() -> bool:
                return not any(is_running(pid) for pid in pids)
            await wait_for(gone, 30, "every child exited")
        finally:  # on failure, end the children this test started
            for pid in filter(is_running, pids):
                os.kill(pid, signal.SIGKILL)


def cluster_pids(state_dir: pathlib.Path) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in json.loads((state_dir / "cluster.json").read_text())["processes"]}


def cluster_addresses(state_dir: pathlib.Path) -> dict[str, str]:
    return {p["name"]: p["address"] for p in json.loads((state_dir / "cluster.json").read_text())["processes"]}


async def kill_and_wait_for_restarts(admin, state_dir: pathlib.Path, names: list[str]) -> None:
    """SIGKILL `names` at once; return when each runs again under a new pid and both instances serve,
    the restarted ones under their new pids."""
    before = cluster_pids(state_dir)
    for name in names:
        os.kill(before[name], signal.SIGKILL)

    async def restarted() -> bool:
        now = cluster_pids(state_dir)
        return all(now[name] != before[name] and is_running(now[name]) for name in names)
    await wait_for(restarted, 60, f"{names} running again")
    now = cluster_pids(state_dir)

    async def both_serving() -> bool:
        infos = await instances(admin)
        return {"instance-0", "instance-1"} <= set(infos) and all(
            i.state == common_pb2.INSTANCE_STATE_SERVING and i.pid == now[i.instance_id] for i in infos.values())
    await wait_for(both_serving, 60, "both instances registered and serving")

    async def transfer_maps_both() -> bool:  # a restarted transfer service is mapped again within a second
        async with TransferClient(cluster_addresses(state_dir)["transfer-0"]) as transfer:
            with contextlib.suppress(Unavailable):
                return set((await transfer.get_status()).instance_ids) == {"instance-0", "instance-1"}
        return False
    await wait_for(transfer_maps_both, 30, "transfer-0 mapping both instances' KV caches")


@pytest.mark.timeout(300)
async def test_children_that_exit_start_again_and_the_cluster_serves_and_migrates(tiny_model_dir, tmp_path, reference):
    """A killed instance comes back (same port and id) and registers again before its old lease ends;
    then etcd and the transfer service SIGKILLed at once come back too: the instances register again,
    the transfer service maps both KV caches again, and a request migrates onto the restarted
    instance with its reference tokens."""
    state_dir = tmp_path / "state"
    with launched_cluster(tiny_model_dir, state_dir, "--instances", "2", "--kv-cache-mib", "16") as cluster:
        # The client closes on this test's loop (left to the GC, it closes in a task on a later test's loop and fails).
        async with (grpc.aio.insecure_channel(cluster["admin_address"]) as channel,
                    openai.AsyncOpenAI(base_url=f"{cluster['frontend_url']}/v1", api_key="unused",
                                       max_retries=0) as client):
            admin = manager_pb2_grpc.AdminServiceStub(channel)
            for killed in (["instance-1"], ["etcd", "transfer-0"]):
                await kill_and_wait_for_restarts(admin, state_dir, killed)
            # flood: every request to instance-0, the first serving by id
            await admin.SetPolicy(manager_pb2.Policy(dispatch="flood", migration_enabled=False), timeout=5)
            # As long as the context allows, so it still runs when Migrate lands: 400 tokens took 1.0 s in all
            # at load 14, 0.25 s of it before the migration committed (polling ListRequests, then Migrate).
            prompt, max_tokens = "A request that moves onto a restarted instance", 1000
            completion = asyncio.ensure_future(client.completions.create(
                model=model_name(cluster), prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True}))

            async def running_request() -> str | None:
                reply = await admin.ListRequests(manager_pb2.AdminListRequestsRequest(), timeout=5)
                return next((r.request_id for r in reply.requests if r.num_output_tokens >= 4), None)
            request_id = await wait_for(running_request, 60, "the request decoding on instance-0")
            moved = await admin.Migrate(manager_pb2.MigrateRequest(request_id=request_id, dst_instance_id="instance-1"),
                                        timeout=60)
            assert (moved.src_instance_id, moved.dst_instance_id) == ("instance-0", "instance-1")
            assert moved.num_blocks > 0
            assert (await completion).choices[0].model_extra["token_ids"] == reference([prompt], max_tokens)[0]
