"""pytest plugin: every process this pytest starts ends with it, even when pytest is SIGKILLed.

At configure time it starts tests/reaper.py (one small process, in a session of its own)
with a pipe whose write end only this process holds, and wraps `subprocess.Popen.__init__`
(which `asyncio.create_subprocess_exec` goes through too) so that every child started from
any thread is registered there as `PID START_TIME`. When pytest is gone, however it died,
the pipe reaches EOF and the reaper ends those children still running (see its docstring).

Why not PR_SET_PDEATHSIG: it fires when the *thread* that started the child ends, and tests
start children from event-loop and worker threads that end long before the child does.
Services know nothing of this: it lives in the test process alone.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import warnings

from tests.reaper import start_time

REAPER = pathlib.Path(__file__).with_name("reaper.py")

_reaper: subprocess.Popen | None = None  # kept for the life of this process: its stdin is the pipe
_pipe_fd: int | None = None  # None: no reaper (not Linux, not installed, or it exited)
_original_init = subprocess.Popen.__init__


def pytest_configure() -> None:
    install()


def install() -> None:
    """Start the reaper and register every later child with it; once per process (Linux only)."""
    global _reaper, _pipe_fd
    if _reaper is not None or not os.path.isdir("/proc"):
        return
    _reaper = subprocess.Popen([sys.executable, "-I", "-S", str(REAPER), str(os.getpid())], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, start_new_session=True)
    _pipe_fd = _reaper.stdin.fileno()
    subprocess.Popen.__init__ = _registering_init


@functools.wraps(_original_init)
def _registering_init(self: subprocess.Popen, *args, **kwargs) -> None:
    _original_init(self, *args, **kwargs)
    register(self.pid)


def register(pid: int) -> None:
    """Tell the reaper about a child of this process (not yet waited for, so its pid is still its own)."""
    global _pipe_fd
    start = start_time(pid)
    if _pipe_fd is None or start is None:
        return
    try:
        os.write(_pipe_fd, f"{pid} {start}\n".encode())  # one short write: atomic on a pipe
    except OSError as exc:  # the reaper is gone: children are no longer guarded, say so once
        _pipe_fd = None
        warnings.warn(f"tests/reaper.py exited ({exc}): processes started from now on may outlive a killed pytest",
                      stacklevel=2)
