"""The name of an instance's KV cache segment in /dev/shm, and reclaiming ones left behind.

`ferry-kv-<host>-<pid>`: unique among live instances that share a /dev/shm, also across
containers that share one IPC namespace (compose's instances join the transfer service's)
but each run as PID 1 of their own, since each has its own host name.

A SIGKILLed or OOM-killed instance cannot unlink its segment. The next instance started on
the same host removes every `ferry-kv-<host>-<pid>` whose process is gone (pids are of this
host's namespace), its own name included: the earlier holder of its pid is dead, as in a
container that restarts as PID 1 again. The name goes at once; a transfer service that still
maps the memory lets go of it within seconds once the name is gone or reused (`unmap_vanished`).
"""

from __future__ import annotations

import os
import re

import structlog

from services.common.ids import host_word
from services.instance.engine.kv_cache import SHM_DIR

log = structlog.get_logger(__name__)

PREFIX = "ferry-kv-"


def segment_name(pid: int | None = None, host: str | None = None) -> str:
    return f"{PREFIX}{host_word(host)}-{os.getpid() if pid is None else pid}"


def reclaim_stale_segments(host: str | None = None) -> list[str]:
    """Unlink this host's instance segments whose process is gone (ours included); their names."""
    own_pid = os.getpid()
    pattern = re.compile(re.escape(PREFIX + host_word(host)) + r"-(\d+)")
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        match = pattern.fullmatch(path.name)
        if match is None or (int(match[1]) != own_pid and _is_alive(int(match[1]))):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another instance starting now took it first
        removed.append(path.name)
    if removed:
        log.warning("kv_segments_reclaimed", names=removed, reason="left by instances that were killed on this host")
    return removed


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True
