"""stop_all: every child gets SIGTERM before any is waited for; one that ignores it is SIGKILLed."""

import signal
import subprocess
import sys

import pytest

from services.cluster.processes import ServiceProcess, stop_all

pytestmark = pytest.mark.timeout(60)

# Writes "term <time>" on SIGTERM, lingers 1 s, then writes "exit <time>" and exits.
_SLOW_TO_STOP = """
import signal, sys, time
def on_term(*_):
    print("term", time.monotonic(), flush=True)
    time.sleep(1.0)
    print("exit", time.monotonic(), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""
_IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def _child(tmp_path, name: str, code: str) -> ServiceProcess:
    process = ServiceProcess(name, "none", [], "", tmp_path)
    process.popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.popen.stdout.readline().strip() == "ready"
    return process


def _times(process: ServiceProcess) -> dict[str, float]:
    return {word: float(value) for word, value in (line.split() for line in process.popen.stdout.read().splitlines())}


def test_children_stop_side_by_side(tmp_path):
    first, second = _child(tmp_path, "a", _SLOW_TO_STOP), _child(tmp_path, "b", _SLOW_TO_STOP)
    stop_all([first, second], timeout_s=20)
    first_times, second_times = _times(first), _times(second)
    assert second_times["term"] < first_times["exit"], "the second child was signalled only after the first exited"
    assert first.popen.returncode == second.popen.returncode == 0


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    stubborn, polite = _child(tmp_path, "stubborn", _IGNORES_TERM), _child(tmp_path, "polite", _SLOW_TO_STOP)
    stop_all([stubborn, polite], timeout_s=2)
    assert stubborn.popen.returncode == -signal.SIGKILL
    assert polite.popen.returncode == 0 and not polite.is_alive()
