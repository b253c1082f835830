"""`python -I tests/reaper.py PYTEST_PID`: end what a pytest run started, once that run is gone.

The pytest process (tests/reaper_plugin.py) starts this at session start, in a session of
its own (a signal to pytest's process group does not reach it), and writes one line
`PID START_TIME` to its stdin for every child it starts, from any thread. The session is
over when stdin reaches EOF or when PYTEST_PID is no longer our parent (SIGKILL, OOM kill,
a runner's cancel: however pytest died). Then every registered child still running is sent
SIGTERM, with the members of the process group or session it leads and its descendants;
after GRACE_S whatever is left gets SIGKILL; then this exits.

* A process is only ever signalled if its pid *and* start time (field 22 of /proc/PID/stat)
  match what was registered or seen in the snapshot, so a reused pid is never touched.
* After a normal run the fixtures have stopped everything: nothing matches, and this exits
  at once.
* The registry is bounded: past MAX_REGISTERED, the pids no longer running are dropped, and
  if it is still full, the oldest.

Standard library only: it runs with `-I -S`, started before anything is imported.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

GRACE_S = 2.0  # between SIGTERM and SIGKILL
POLL_S = 0.5  # how often to check that pytest is still our parent
MAX_REGISTERED = 4096


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """What /proc/PID/stat says about one process."""

    ppid: int
    pgrp: int
    session: int
    start_time: int  # clock ticks after boot: with the pid, it names one process for good
    is_zombie: bool


def read_stat(pid: int) -> ProcInfo | None:
    """None if `pid` does not exist (or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    try:  # fields[0] is field 3 (state) of proc(5)
        return ProcInfo(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0] == "Z")
    except (IndexError, ValueError):
        return None


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for its new parent to reap it)."""
    info = read_stat(pid)
    return info is not None and not info.is_zombie


def start_time(pid: int) -> int | None:
    info = read_stat(pid)
    return info.start_time if info else None


def process_table() -> dict[int, ProcInfo]:
    """Every process now running (zombies left out)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := read_stat(int(name))) and not info.is_zombie:
            table[int(name)] = info
    return table


class Registry:
    """pid -> start time of every child registered, at most `max_size` of them."""

    def __init__(self, max_size: int = MAX_REGISTERED) -> None:
        self.max_size = max_size
        self.children: dict[int, int] = {}  # insertion order: oldest first

    def add(self, pid: int, start: int) -> None:
        self.children.pop(pid, None)
        self.children[pid] = start
        if len(self.children) > self.max_size:
            self.prune()

    def prune(self) -> None:
        """Drop the children no longer running; then, if still over the bound, the oldest."""
        self.children = {pid: start for pid, start in self.children.items() if start_time(pid) == start}
        while len(self.children) > self.max_size:
            del self.children[next(iter(self.children))]

    def add_lines(self, data: bytes) -> None:
        """Register each complete `PID START_TIME` line; anything else is ignored."""
        for line in data.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                self.add(int(parts[0]), int(parts[1]))


def targets(children: Mapping[int, int], table: Mapping[int, ProcInfo]) -> dict[int, int]:
    """pid -> start time of every process to end: each registered child still running (same pid and
    start time), every member of a process group or session it leads, and their descendants."""
    roots = {pid for pid, start in children.items() if pid in table and table[pid].start_time == start}
    found = set(roots) | {pid for pid, info in table.items() if info.pgrp in roots or info.session in roots}
    by_parent: dict[int, list[int]] = {}
    for pid, info in table.items():
        by_parent.setdefault(info.ppid, []).append(pid)
    pending = list(found)
    while pending:
        for child in by_parent.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return {pid: table[pid].start_time for pid in found}


def still_running(victims: Mapping[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in victims.items()
            if (info := read_stat(pid)) and info.start_time == start and not info.is_zombie}


def send(victims: Mapping[int, int], sig: int) -> list[int]:
    """Signal each one still running (checked just before); the pids signalled."""
    signalled = []
    for pid in still_running(victims):
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        signalled.append(pid)
    return signalled


def reap(victims: Mapping[int, int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each of `victims` (pid -> start time) still running, wait up to `grace_s` for them to end,
    SIGKILL the rest; the pids that got SIGTERM."""
    signalled = send(victims, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while still_running(victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    send(victims, signal.SIGKILL)
    return signalled


def wait_for_session_end(registry: Registry, fd: int, pytest_pid: int) -> None:
    """Register children from `fd` until it reaches EOF or `pytest_pid` stops being our parent."""
    pending = b""
    while os.getppid() == pytest_pid:
        if not select.select([fd], [], [], POLL_S)[0]:
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        complete, _, pending = (pending + data).rpartition(b"\n")
        registry.add_lines(complete)
    registry.add_lines(pending + _drain(fd))


def _drain(fd: int) -> bytes:
    """What is left to read without blocking (a forked child may still hold the write end)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def describe(pid: int) -> str:
    """`PID (COMMAND)`, as /proc has it now."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return f"{pid} ({comm.read().strip()})"
    except OSError:
        return str(pid)


def reap_and_report(children: Mapping[int, int], pytest_pid: int) -> None:
    """`reap`, then name on stderr what had to be stopped: a test or fixture that did not stop it."""
    victims = targets(children, process_table())
    names = {pid: describe(pid) for pid in victims}
    signalled = reap(victims)
    if signalled:
        print(f"tests/reaper.py: pytest (pid {pytest_pid}) ended with processes it started still running; "
              f"stopped {', '.join(names[pid] for pid in signalled)}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.exit("usage: python tests/reaper.py PYTEST_PID  (children as `PID START_TIME` lines on stdin)")
    for sig in (signal.SIGINT, signal.SIGHUP):  # a Ctrl-C or a closed terminal ends pytest, not us
        signal.signal(sig, signal.SIG_IGN)
    registry = Registry()
    wait_for_session_end(registry, sys.stdin.fileno(), int(argv[0]))
    reap_and_report(registry.children, int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
