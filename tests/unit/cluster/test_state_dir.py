"""One launcher per --state-dir: a second `up` on a state dir in use is refused at once, naming
the holder, and a holder that died (even by SIGKILL) never blocks the next one."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from services.cluster.launcher import LocalCluster, PortInUse, run_until_signalled
from services.cluster.state_dir import StateDirInUse, StateDirLock
from services.common.etcd_launcher import free_port
from tests.unit.cluster.test_ports import spec as ports_spec

pytestmark = pytest.mark.timeout(20)


def test_a_second_lock_is_refused_naming_the_holder_until_the_first_is_released(tmp_path):
    first, second = StateDirLock(tmp_path), StateDirLock(tmp_path)
    first.acquire()
    with pytest.raises(StateDirInUse, match=f"--state-dir {tmp_path} is in use .*launcher PID {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


def test_a_killed_holder_leaves_the_state_dir_free(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys, time; from services.cluster.state_dir import StateDirLock; "
         f"StateDirLock(pathlib.Path({str(tmp_path)!r})).acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse, match=f"launcher PID {holder.pid}"):
            StateDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    lock = StateDirLock(tmp_path)
    lock.acquire()
    lock.release()


async def test_a_refused_launcher_leaves_the_running_clusters_state_alone(tmp_path):
    holder = StateDirLock(tmp_path)
    holder.acquire()
    (tmp_path / "cluster.json").write_text("{}")
    spec = dataclasses.replace(ports_spec(free_port(), free_port()), state_dir=tmp_path)
    try:
        with pytest.raises(StateDirInUse):
            await run_until_signalled(LocalCluster(spec))
        assert (tmp_path / "cluster.json").read_text() == "{}"
    finally:
        holder.release()


async def test_a_second_cluster_on_a_held_state_dir_names_the_holder_even_on_the_same_ports(tmp_path):
    """Running the same `up` twice: its ports are taken too, but what to say is who holds the dir."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = dataclasses.replace(ports_spec(port, port), state_dir=tmp_path)
        holder = StateDirLock(tmp_path)
        holder.acquire()
        try:
            with pytest.raises(StateDirInUse, match=f"launcher PID {os.getpid()}"):
                await run_until_signalled(LocalCluster(spec))
        finally:
            holder.release()


async def test_a_killed_launchers_cluster_json_is_gone_before_anything_starts(tmp_path):
    """Scripts wait for cluster.json as "ready": one a SIGKILLed launcher left (dead PIDs) must not say so
    while the next `up` is still starting (here it stops at once: its --http-port is taken)."""
    (tmp_path / "cluster.json").write_text('{"processes": [{"name": "frontend-0", "pid": 999999}]}')
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        spec = dataclasses.replace(ports_spec(taken.getsockname()[1], free_port()), state_dir=tmp_path)
        with pytest.raises(PortInUse):
            await run_until_signalled(LocalCluster(spec))
    assert not (tmp_path / "cluster.json").exists()


def test_a_failed_rewrite_of_cluster_json_is_logged_and_tried_again_not_raised(tmp_path):
    """A full disk while serving: before, the OSError stopped every child."""
    cluster = LocalCluster(dataclasses.replace(ports_spec(free_port(), free_port()), state_dir=tmp_path))
    cluster.state = lambda: {"processes": []}
    (tmp_path / "cluster.json.tmp").mkdir()  # the write fails as on a full disk
    cluster.rewrite_state()
    assert cluster.is_state_stale and not (tmp_path / "cluster.json").exists()
    (tmp_path / "cluster.json.tmp").rmdir()
    cluster.rewrite_state()
    assert not cluster.is_state_stale and (tmp_path / "cluster.json").read_text() == '{\n  "processes": []\n}'
