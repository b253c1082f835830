"""Log files of child processes (the launcher's services, its etcd): bounded across restarts."""

from __future__ import annotations

import os
import pathlib

MAX_LOG_BYTES = 64 * 2**20


def rotate_log(path: pathlib.Path, max_bytes: int = MAX_LOG_BYTES) -> None:
    """Before a child (re)starts: a log past `max_bytes` becomes `<name>.log.1` (replacing the one
    before), so restarts and kept state dirs never grow logs without bound. A child that runs for
    weeks writes on: logrotate's copytruncate handles that (children append with O_APPEND)."""
    try:
        if path.stat().st_size > max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
