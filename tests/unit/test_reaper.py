"""tests/reaper.py: what it ends when pytest is gone, and what it never touches."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from tests import reaper_plugin
from tests.reaper import ProcInfo, Registry, reap, start_time, targets, wait_for_session_end

pytestmark = pytest.mark.timeout(30)


def info(ppid: int, pgrp: int, session: int, start: int) -> ProcInfo:
    return ProcInfo(ppid=ppid, pgrp=pgrp, session=session, start_time=start, is_zombie=False)


TABLE = {
    1: info(0, 1, 1, 1),
    100: info(1, 100, 100, 50),  # pytest
    200: info(100, 200, 200, 70),  # a child in its own session
    201: info(200, 200, 200, 71),  # ... its child, in its group
    202: info(1, 202, 200, 72),  # ... orphaned, in another group of its session
    203: info(201, 203, 203, 73),  # ... a grandchild in a session of its own
    300: info(100, 1, 1, 80),  # a child in pytest's group
    400: info(1, 400, 400, 90),  # unrelated
}


def test_a_registered_child_takes_its_group_session_and_descendants():
    assert targets({200: 70}, TABLE) == {200: 70, 201: 71, 202: 72, 203: 73}


def test_a_child_in_someone_elses_group_takes_only_itself_and_its_descendants():
    assert targets({300: 80}, TABLE) == {300: 80}


def test_a_pid_whose_start_time_differs_is_left_alone():
    assert targets({200: 69, 400: 1}, TABLE) == {}


def test_a_reused_pid_is_never_signalled():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert reap({child.pid: start_time(child.pid) + 1}, grace_s=0.1) == []
        assert child.poll() is None
        assert reap({child.pid: start_time(child.pid)}, grace_s=10) == [child.pid]  # returns once it ended
        assert child.wait(5) == -15  # SIGTERM was enough
    finally:
        child.kill()
        child.wait()


def test_the_registry_drops_ended_children_then_the_oldest_past_its_bound():
    registry = Registry(max_size=2)
    running = [os.getppid(), os.getpid()]
    for pid in running:
        registry.add(pid, start_time(pid))
    registry.add(999_999_999, 1)  # no such process: dropped when the registry outgrows its bound
    assert list(registry.children) == running
    child = subprocess.Popen(["sleep", "60"])
    try:
        registry.add(child.pid, start_time(child.pid))  # all three run: the oldest goes
        assert list(registry.children) == [os.getpid(), child.pid]
    finally:
        child.kill()
        child.wait()


def test_registration_lines_are_read_until_eof():
    read_fd, write_fd = os.pipe()
    registry = Registry()
    reader = threading.Thread(target=wait_for_session_end, args=(registry, read_fd, os.getppid()))
    reader.start()
    os.write(write_fd, b"12 34\n56 ")
    os.write(write_fd, b"78\nnot a line\n")
    os.close(write_fd)
    reader.join(5)
    os.close(read_fd)
    assert not reader.is_alive() and registry.children == {12: 34, 56: 78}


def test_the_session_is_over_when_pytest_is_no_longer_the_parent():
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"12 34\n")
        registry = Registry()
        wait_for_session_end(registry, read_fd, pytest_pid=os.getppid() + 1)  # returns without EOF
        assert registry.children == {12: 34}
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_this_session_has_a_reaper_and_registers_with_it():
    """tests/conftest.py loads the plugin, whichever way pytest was started (a file alone, `make test`)."""
    assert reaper_plugin._reaper is not None and reaper_plugin._reaper.poll() is None
    assert reaper_plugin._pipe_fd is not None
    assert subprocess.Popen.__init__ is reaper_plugin._registering_init
