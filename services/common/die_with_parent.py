"""`python die_with_parent.py PARENT_PID CMD [ARGS...]`: become CMD, and be
SIGKILLed when the process that started us goes away.

Linux's PR_SET_PDEATHSIG survives exec, so this sets it and execs CMD in the same process
(same pid). Launchers use it instead of a `preexec_fn`, which forces a plain fork of a
process that runs gRPC threads: gRPC's fork handlers then run in the child before exec
and can abort it (seen: an etcd child dying with SIGABRT, "epoll_wait error: Bad file
descriptor"). Without `preexec_fn`, subprocess starts this with vfork/posix_spawn.
If PARENT_PID is already gone when the signal is armed, it exits instead of running CMD.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def command(cmd: list[str]) -> list[str]:
    """`cmd`, wrapped so that it dies with this process."""
    # Run as a script in isolated mode: it needs nothing but the standard library, and no
    # PYTHONPATH or working directory.
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), *cmd]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python die_with_parent.py PARENT_PID CMD [ARGS...]")
    with contextlib.suppress(OSError, AttributeError):  # not Linux: run without the guarantee
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(argv[0]):
        sys.exit(f"parent {argv[0]} exited before {argv[1]} started")
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
