"""ferryctl (`python -m services.ctl`) against a real manager and instance: every command,
as tables and as --json, the live `top` view, and clean failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from etcd3aio import Etcd3Client

from services.cluster.processes import ROOT
from services.common.etcd_launcher import LocalEtcd, free_port
from services.manager.client import ManagerClient
from tests.integration.manager_harness import ManagerProcess, SimulatedInstance, start_manager, wait_until
from tests.integration.ops_cluster import INSTANCE_ID, OTHER_INSTANCE_ID, ops_cluster, running_request

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ops(etcd, tiny_model_dir, tmp_path_factory):
    with ops_cluster(etcd, tiny_model_dir, tmp_path_factory.mktemp("logs")) as cluster:
        yield cluster


def ctl(*args: str, admin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "services.ctl", *(["--admin", admin] if admin else []), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=full_env)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"{result.args} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result.stdout


def test_instances_table_and_json(ops):
    table = ok(ctl("instances", admin=ops.admin_address))
    header, *rows = table.splitlines()
    assert header.split()[:3] == ["INSTANCE", "ROLE", "STATE"]
    assert [row.split()[:3] for row in rows] == [[i, "both", "serving"] for i in (INSTANCE_ID, OTHER_INSTANCE_ID)]
    instance, _ = json.loads(ok(ctl("--json", "instances", admin=ops.admin_address)))
    assert instance["instance_id"] == INSTANCE_ID and instance["address"] == ops.instance_address
    assert instance["num_total_blocks"] == 256 and instance["state"] == "serving"


def test_status(ops):
    assert "manager-0" in ok(ctl("status", admin=ops.admin_address))
    status = json.loads(ok(ctl("status", "--json", admin=ops.admin_address)))  # global flags also after COMMAND
    assert status["leader_id"] == "manager-0" and status["num_serving"] == 2


def test_admin_address_from_the_environment(ops):
    status = json.loads(ok(ctl("--json", "status", env={"FERRY_CTL_ADMIN": ops.admin_address})))
    assert status["answered_by"] == "manager-0"


def test_several_admin_addresses_use_the_first_manager_that_accepts_a_connection(ops):
    """Any manager answers the admin API: listing them all keeps ferryctl working while one is down."""
    down = f"127.0.0.1:{free_port()}"
    status = json.loads(ok(ctl("--json", "status", admin=f"{down},{ops.admin_address}")))
    assert status["answered_by"] == "manager-0"
    started = time.monotonic()
    none = ctl("--timeout-s", "1", "instances", admin=f"{down},127.0.0.1:{free_port()}")
    assert none.returncode == 1 and f"{down} of --admin {down},127.0.0.1:" in none.stderr, none.stderr
    assert time.monotonic() - started < 30
    bad = ctl("instances", admin=f"{ops.admin_address},nohost")
    assert bad.returncode == 2 and "--admin 'nohost'" in bad.stderr, bad.stderr


def test_policy_get_and_set(ops):
    assert ok(ctl("policy", "get", admin=ops.admin_address)).splitlines()[0].split() == ["dispatch", "load"]
    assert ok(ctl("policy", admin=ops.admin_address)).splitlines()[0].split() == ["dispatch", "load"]  # get: the default
    assert json.loads(ok(ctl("--json", "policy", "set", "round_robin", admin=ops.admin_address)))["dispatch"] == \
        "round_robin"
    policy = json.loads(ok(ctl("--json", "--token", "t0k3n", "policy", "get", admin=ops.admin_address)))
    assert policy["dispatch"] == "round_robin"
    bad = ctl("policy", "set", "fastest", admin=ops.admin_address)
    assert bad.returncode == 1 and "unknown policy 'fastest'" in bad.stderr and "Traceback" not in bad.stderr
    unknown_field = ctl("policy", "set", "--set", "no_such_field=1", admin=ops.admin_address)
    assert unknown_field.returncode == 2 and "policy has no field no_such_field; its fields: dispatch" in \
        unknown_field.stderr and "Available Fields" not in unknown_field.stderr
    for assignment, expected in (("migration_threshold=abc", "a number"), ("migration_enabled=3", "true or false"),
                                 ("scaling_max_instances=2.5", "a whole number")):
        bad_value = ctl("policy", "set", "--set", assignment, admin=ops.admin_address)
        assert bad_value.returncode == 2 and f"--set {assignment}: expected {expected}" in bad_value.stderr, \
            bad_value.stderr
    short = json.loads(ok(ctl("--json", "policy", "set", "--set", "migration_selection=longest_running",
                              admin=ops.admin_address)))  # as the manager's --migration-selection spells it
    assert short["migration_selection"] == "MIGRATION_SELECTION_LONGEST_RUNNING"
    bad_enum = ctl("policy", "set", "--set", "migration_selection=running", admin=ops.admin_address)
    assert bad_enum.returncode == 2 and "expected one of shortest_running, longest_running, last_come_first" in \
        bad_enum.stderr, bad_enum.stderr
    ok(ctl("policy", "set", "load", "--set", "migration_selection=shortest_running", admin=ops.admin_address))


def test_requests_lists_a_running_request(ops):
    with running_request(ops.instance_address, max_tokens=1000) as request_id:
        for _ in range(20):  # a busy instance may miss the manager's ListRequests deadline: ask again
            result = ctl("--json", "requests", "--instance", INSTANCE_ID, admin=ops.admin_address)
            listing = json.loads(result.stdout) if result.returncode == 0 else {"requests": []}
            if any(r["request_id"] == request_id for r in listing["requests"]):
                break
        else:
            pytest.fail(f"{request_id} never listed; last answer {result.stdout}{result.stderr}")
    (row,) = [r for r in listing["requests"] if r["request_id"] == request_id]
    assert row["instance_id"] == INSTANCE_ID and row["num_tokens"] >= 6
    assert listing["unreachable_instance_ids"] == []


def test_requests_table(ops):
    with running_request(ops.instance_address, max_tokens=1000) as request_id:
        for _ in range(20):
            result = ctl("requests", admin=ops.admin_address)
            table = result.stdout
            if result.returncode == 0 and request_id in table:
                break
        else:
            pytest.fail(f"{request_id} never listed; last answer:\n{table}{result.stderr}")
    assert table.splitlines()[0].split()[:3] == ["REQUEST", "INSTANCE", "STATE"]


def test_top_draws_frames(ops):
    text = ok(ctl("top", "--iterations", "2", "--interval", "0.2", admin=ops.admin_address))
    assert text.count("ferry top") == 2 and INSTANCE_ID in text and "\x1b[" not in text  # piped: no screen clearing
    frames = [json.loads(line) for line in ok(ctl("--json", "top", "--iterations", "2", "--interval", "0.2",
                                                  admin=ops.admin_address)).splitlines()]
    assert len(frames) == 2 and [i["instance_id"] for i in frames[1]["instances"]] == [INSTANCE_ID, OTHER_INSTANCE_ID]
    assert frames[1]["status"]["leader_id"] == "manager-0" and INSTANCE_ID in frames[1]["served_per_s"]


def test_migrations(ops):
    result = ctl("--json", "migrations", admin=ops.admin_address)
    if result.returncode == 3:
        assert "not available yet" in result.stderr
        pytest.skip(f"migration history is not available yet: {result.stderr.strip()}")
    assert isinstance(json.loads(ok(result)), list)
    assert ok(ctl("migrations", "--instance", INSTANCE_ID, admin=ops.admin_address))
    assert ok(ctl("migrations", "--instance", "no-such-instance", admin=ops.admin_address)).strip() == (
        "no migrations (and no instance no-such-instance is registered now; the history keeps instances that are gone)")


def test_role_changes_an_instances_role_and_back(ops):
    """ferryctl role once always answered "not available yet": it built a request type the admin API does not take."""
    try:
        assert ok(ctl("role", OTHER_INSTANCE_ID, "decode", admin=ops.admin_address))
        roles = {i["instance_id"]: i["role"] for i in json.loads(ok(ctl("--json", "instances", admin=ops.admin_address)))}
        assert roles[OTHER_INSTANCE_ID] == "decode"
    finally:
        assert ok(ctl("role", OTHER_INSTANCE_ID, "both", admin=ops.admin_address))
    unknown = ctl("role", "no-such-instance", "both", admin=ops.admin_address)
    assert unknown.returncode == 1 and "no-such-instance" in unknown.stderr and "Traceback" not in unknown.stderr


def test_migrate(ops):
    with running_request(ops.instance_address, max_tokens=1000):
        result = ctl("--json", "migrate", "--src", INSTANCE_ID, "--dst", OTHER_INSTANCE_ID, admin=ops.admin_address)
    if result.returncode == 3:
        assert "not available yet" in result.stderr and json.loads(result.stdout)["code"] == "NotAvailableYet"
        pytest.skip(f"migration is not available yet: {result.stderr.strip()}")
    moved = json.loads(ok(result))
    assert (moved["src_instance_id"], moved["dst_instance_id"]) == (INSTANCE_ID, OTHER_INSTANCE_ID)
    assert moved["num_blocks"] > 0 and moved["downtime_ms"] >= 0


def test_migrate_from_a_source_without_the_request_names_where_it_runs(ops):
    """An operator's wrong --src: the error says where the request is (the failed try is kept, as every one)."""
    with running_request(ops.instance_address, max_tokens=1000) as request_id:
        for _ in range(20):  # a busy instance may miss the manager's ListRequests deadline: ask again
            result = ctl("migrate", "--request", request_id, "--src", OTHER_INSTANCE_ID, "--dst", INSTANCE_ID,
                         admin=ops.admin_address)
            if "runs on" in result.stderr:
                break
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"is not on instance {OTHER_INSTANCE_ID}: it runs on {INSTANCE_ID}" in result.stderr
    history = json.loads(ok(ctl("--json", "migrations", "--request", request_id, admin=ops.admin_address)))
    assert [(r["outcome"], r["reason"]) for r in history] == [("failed", "NOT_FOUND")] * len(history) != []


def test_migrating_an_n_request_by_its_own_id_names_its_choices(ops):
    parent = f"cmpl-{uuid.uuid4().hex[:8]}"
    with running_request(ops.instance_address, request_id=f"{parent}-0"), \
            running_request(ops.instance_address, request_id=f"{parent}-1"):
        for _ in range(10):  # a busy instance may miss the manager's ListRequests deadline: ask again
            result = ctl("migrate", "--request", parent, admin=ops.admin_address)
            if "per choice" in result.stderr:
                break
    assert result.returncode == 1 and f"migrate one of {parent}-0, {parent}-1" in result.stderr, result.stderr


def test_failures_say_what_to_fix(ops):
    unknown = ctl("drain", "no-such-instance", admin=ops.admin_address)
    assert unknown.returncode == 1 and "not registered" in unknown.stderr
    for argv in (("requests", "--instance", "../x"), ("drain", "x" * 5000), ("migrate", "--src", "a/b")):
        not_an_id = ctl(*argv, admin=ops.admin_address)  # INVALID_ARGUMENT naming the field, the id cut short
        assert not_an_id.returncode == 1 and "instance_id: '" in not_an_id.stderr, not_an_id.stderr
        assert len(not_an_id.stderr) < 1000, not_an_id.stderr
    started = time.monotonic()
    down = ctl("--timeout-s", "1", "instances", admin=f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "FERRY_CTL_ADMIN" in down.stderr and "Traceback" not in down.stderr
    assert time.monotonic() - started < 30
    usage = ctl("role", INSTANCE_ID, "leader", admin=ops.admin_address)
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


def test_healthcheck_command(ops):
    """What the compose health checks run."""
    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.ctl.healthcheck", *args], capture_output=True,
                              text=True, timeout=30, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    assert check(ops.admin_address).stdout.strip() == f"{ops.admin_address}: SERVING"
    assert check(ops.instance_address, "--service", "ferry.v1.InstanceService").returncode == 0
    assert check("--timeout-s", "1", f"127.0.0.1:{free_port()}").returncode == 1
    assert check("--timeout-s", "1", f"http://127.0.0.1:{free_port()}").returncode == 1


def test_drain_last(ops):
    """Runs last in this module: the instance is drained, then taken back."""
    assert ok(ctl("drain", INSTANCE_ID, admin=ops.admin_address)).startswith(
        (f"instance {INSTANCE_ID} is draining: no new requests go to it",  # its requests are still moving
         f"instance {INSTANCE_ID} is drained: no new requests go to it, and nothing runs there"))
    states = {i["instance_id"]: i["state"] for i in json.loads(ok(ctl("--json", "instances", admin=ops.admin_address)))}
    assert states == {INSTANCE_ID: "draining", OTHER_INSTANCE_ID: "serving"}
    assert json.loads(ok(ctl("--json", "drain", INSTANCE_ID, admin=ops.admin_address)))["state"] == "draining"
    assert ok(ctl("drain", INSTANCE_ID, "--undo", admin=ops.admin_address)).strip() == (
        f"instance {INSTANCE_ID} is serving: new requests reach it again")
    states = {i["instance_id"]: i["state"] for i in json.loads(ok(ctl("--json", "instances", admin=ops.admin_address)))}
    assert states == {INSTANCE_ID: "serving", OTHER_INSTANCE_ID: "serving"}


async def test_an_instance_the_manager_has_no_load_report_of_shows_unknown_load_not_idle(etcd, cluster, tmp_path):
    """A leader elected or restarted moments ago has heard no load report yet (1-2 s with real instances):
    `instances` showed every instance idle (0 running, every block free) while they ran requests, and
    `status` counted them so. Here one instance reports 3 running, another is registered but silent."""
    manager = await start_manager(etcd.endpoint, cluster, "m-ctl", tmp_path, "--report-timeout-s", "60")
    busy = SimulatedInstance("i-busy", "127.0.0.1:9301", num_running=3, num_free_blocks=900)
    silent = SimulatedInstance("i-silent", "127.0.0.1:9302")
    etcd_client = Etcd3Client([etcd.endpoint])
    await etcd_client.connect()
    try:
        for instance in (busy, silent):
            await instance.register(etcd_client, cluster)
        busy.start_reporting(lambda: [manager.address])
        async with ManagerClient(manager.address) as client:
            async def both_listed_busy_heard():
                infos = {i.instance_id: i for i in await client.list_instances()}
                return len(infos) == 2 and infos["i-busy"].report_age_s >= 0
            await wait_until(both_listed_busy_heard, 20, "i-busy reported and i-silent listed")
        table = ok(await asyncio.to_thread(ctl, "instances", admin=manager.address))
        rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
        assert rows["i-busy"][3:7] == ["3", "0", "?/?", "900/1000"]
        assert rows["i-silent"][3:11] == ["?", "?", "?/?", "?/1000", "?", "?", "?", "?"]
        status = ok(await asyncio.to_thread(ctl, "status", admin=manager.address))
        assert "1 instance not reported to m-ctl yet: the figures above count them as idle" in status
    finally:
        await busy.stop()
        await etcd_client.close()
        await manager.stop()


@contextlib.asynccontextmanager
async def reporting_to_a_manager(etcd_endpoint: str, cluster: str, tmp_path, manager_id: str,
                                 instance: SimulatedInstance, *manager_args: str) -> AsyncIterator[ManagerProcess]:
    """A real manager process, and `instance` registered in etcd and reporting its load to it."""
    manager = await start_manager(etcd_endpoint, cluster, manager_id, tmp_path, *manager_args)
    try:
        etcd_client = Etcd3Client([etcd_endpoint])
        await etcd_client.connect()
        try:
            await instance.register(etcd_client, cluster)
        finally:
            await etcd_client.close()
        instance.start_reporting(lambda: [manager.address])
        yield manager
    finally:
        await instance.stop()
        await manager.stop()


async def test_instances_during_an_etcd_outage_say_no_manager_leads_and_whose_view_it_is(cluster, tmp_path):
    """etcd away past the lease TTL: the leader steps down, no load report reaches it, and it shows every
    instance unhealthy. `status` and `top` said no manager leads and whose view that was; `instances` showed
    the unhealthy rows with no word of why. Its own etcd: stopping the module's would cut the ops cluster's."""
    instance = SimulatedInstance("i-serving", "127.0.0.1:9303")
    with LocalEtcd() as etcd:
        async with reporting_to_a_manager(etcd.endpoint, cluster, tmp_path, "m-alone", instance, "--lease-ttl-s", "2",
                                          "--report-timeout-s", "1") as manager, \
                ManagerClient(manager.address) as client:
            async def serving_with_a_leader():
                infos, status = await client.list_instances(), await client.get_cluster_status()
                return status.leader_id == "m-alone" and [i.report_age_s >= 0 for i in infos] == [True]
            await wait_until(serving_with_a_leader, 20, "i-serving reported to leader m-alone")
            table = ok(await asyncio.to_thread(ctl, "instances", admin=manager.address))
            assert "no leader" not in table and table.splitlines()[1].split()[2] == "serving"
            await asyncio.to_thread(etcd.terminate)

            async def leaderless():
                return (await client.get_cluster_status()).leader_id == ""
            await wait_until(leaderless, 20, "m-alone saying no manager leads")
            result = await asyncio.to_thread(ctl, "instances", admin=manager.address)
            header, row, *notes = ok(result).splitlines()
            assert row.split()[:3] == ["i-serving", "both", "unhealthy"]
            assert notes == ["no leader: m-alone's view: no load reports reach it, so it counts instances as "
                             "unhealthy that may well serve (etcd unreachable, or an election under way; frontends "
                             "place requests themselves meanwhile)"]
            as_json = await asyncio.to_thread(ctl, "--json", "instances", admin=manager.address)
            assert [i["state"] for i in json.loads(ok(as_json))] == ["unhealthy"]  # still the list scripts read
            assert as_json.stderr.strip() == f"ferryctl: {notes[0]}"


async def test_top_shows_each_instances_preemptions_per_second(etcd, cluster, tmp_path):
    """Preemptions (KV pressure) were in /metrics alone: the load report did not carry them, and `top` and
    `instances` could not show them."""
    pressed = SimulatedInstance("i-pressed", "127.0.0.1:9304", num_running=4, num_free_blocks=0, num_preemptions=5)
    async with reporting_to_a_manager(etcd.endpoint, cluster, tmp_path, "m-kv", pressed, "--report-timeout-s",
                                      "60") as manager:
        async with ManagerClient(manager.address) as client:
            async def reported():
                return [i.num_preemptions for i in await client.list_instances()] == [5]
            await wait_until(reported, 20, "i-pressed's preemptions reported")
        (row,) = json.loads(ok(await asyncio.to_thread(ctl, "--json", "instances", admin=manager.address)))
        assert row["num_preemptions"] == 5
        table = ok(await asyncio.to_thread(ctl, "instances", admin=manager.address)).splitlines()
        assert table[0].split()[9:11] == ["SERVED", "PREEMPT"] and table[1].split()[9] == "5"
        top = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.ctl", "--admin", manager.address, "--json", "top", "--iterations", "2",
            "--interval-s", "3", cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE)
        first = json.loads(await asyncio.wait_for(top.stdout.readline(), 60))
        pressed.num_preemptions = 11  # 6 more before the second frame, 3 s later
        second = json.loads(await asyncio.wait_for(top.stdout.readline(), 60))
        assert await top.wait() == 0
        assert first["preempted_per_s"] == {} and 1.0 <= second["preempted_per_s"]["i-pressed"] <= 2.0
        frame = ok(await asyncio.to_thread(ctl, "top", "--iterations", "1", admin=manager.address)).splitlines()
        header = next(line for line in frame if line.startswith("INSTANCE"))
        assert "REQ/S  PREEMPT/S" in header
