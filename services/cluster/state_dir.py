"""One launcher per --state-dir: its etcd data, cluster.json and logs belong to one cluster at a time.

The lock is an flock on `<state dir>/launcher.lock`, held for the launcher's life; the kernel drops
it when the launcher dies however it dies, so a stale lock file never blocks the next `up`.
"""

from __future__ import annotations

import fcntl
import os
import pathlib

LOCK_FILE = "launcher.lock"


class StateDirInUse(RuntimeError):
    """Another running launcher holds the state dir."""


class StateDirUnusable(RuntimeError):
    """The state dir cannot be made a directory (a file in the way, no permission, a read-only disk)."""


class StateDirLock:
    def __init__(self, state_dir: pathlib.Path) -> None:
        self._path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (writing our PID into the file) or raise StateDirInUse naming the holder's PID."""
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirInUse(f"--state-dir {self._path.parent} is in use by another cluster (launcher PID "
                                f"{holder}); stop that one or pick another --state-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    @property
    def is_held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
