"""A pytest run that is SIGKILLed takes the processes its tests started with it (tests/reaper.py):
a service process in its own session, that process's own child, and an asyncio subprocess
started from a worker thread that ended long before."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.cluster.processes import ROOT
from tests.reaper import is_running

pytestmark = pytest.mark.timeout(60)

# The test the SIGKILLed pytest runs: it starts its children the way the integration tests
# do, writes their pids to pids.txt, and sleeps until it is killed.
CHILD_TEST = textwrap.dedent('''
    import asyncio, pathlib, sys, threading, time
    from services.cluster.processes import ServiceProcess

    SLEEPER = "import subprocess, sys, time; print(subprocess.Popen(['sleep', '600']).pid, flush=True); time.sleep(600)"

    async def started_from_a_thread(log_dir):
        return await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(600)",
                                                    start_new_session=True)

    def test_sleeps(tmp_path):
        out = pathlib.Path(__file__).with_name("pids.txt")
        # `python -c SLEEPER python -m services.sleeper`: the -c script runs, the rest are its argv
        service = ServiceProcess("sleeper", "sleeper", [], "", tmp_path, prefix=[sys.executable, "-c", SLEEPER]).start()
        box = []
        thread = threading.Thread(target=lambda: box.append(asyncio.run(started_from_a_thread(tmp_path))))
        thread.start()
        thread.join()
        while not service.log_path.read_text().strip():
            time.sleep(0.05)
        pids = [service.pid, int(service.log_path.read_text().split()[0]), box[0].pid]
        out.write_text(" ".join(map(str, pids)))
        time.sleep(600)
''')


def reapers_of(pytest_pid: int) -> list[int]:
    """The pids of tests/reaper.py processes started by `pytest_pid`."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and argv[-2:] == [str(pytest_pid).encode(), b""] and argv[-3].endswith(b"reaper.py"):
            found.append(int(entry.name))
    return found


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def wait_for_pids(path: pathlib.Path, runner: subprocess.Popen, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert runner.poll() is None, f"the inner pytest exited with {runner.returncode}"
        assert time.monotonic() < deadline, "the inner test never wrote its pids"
        time.sleep(0.1)
    return [int(pid) for pid in path.read_text().split()]


def test_children_of_a_sigkilled_pytest_are_killed(tmp_path):
    (tmp_path / "test_inner.py").write_text(CHILD_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.reaper_plugin", "-p", "no:cacheprovider",
               "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]
    stderr = tmp_path / "inner-stderr.log"
    with open(stderr, "wb") as stderr_file:
        runner = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=subprocess.DEVNULL, stderr=stderr_file, start_new_session=True)
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path / "pids.txt", runner, 30)
        assert all(is_running(pid) for pid in pids) and len(reapers_of(runner.pid)) == 1
        runner.kill()
        runner.wait(5)
        assert wait_until(lambda: not any(is_running(pid) for pid in pids), 10), [p for p in pids if is_running(p)]
        assert wait_until(lambda: not reapers_of(runner.pid), 5), "the reaper outlived its pytest"
        report = stderr.read_text()
        assert f"pytest (pid {runner.pid}) ended with processes it started still running" in report
        assert all(str(pid) in report for pid in pids)
    finally:  # on failure, end what this test started
        runner.kill()
        for pid in filter(is_running, pids):
            os.kill(pid, signal.SIGKILL)
