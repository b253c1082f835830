"""Instance KV segments: named by host and pid; those of dead processes on this host are reclaimed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from services.instance.engine.kv_cache import SHM_DIR
from services.common.ids import host_word
from services.instance.kv_segments import reclaim_stale_segments, segment_name


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_names_are_one_safe_word_with_host_and_pid():
    assert segment_name(pid=1, host="web-7.example") == "ferry-kv-web-7.example-1"
    assert host_word("a b/c") == "a_b_c" and len(host_word("h" * 300)) == 64 and host_word("-x") == "h-x"
    assert segment_name().endswith(f"-{os.getpid()}")


def test_a_dead_processes_segment_and_our_own_pids_are_reclaimed_a_live_ones_and_other_hosts_are_not():
    host = f"test-{uuid.uuid4().hex[:8]}"
    names = {"dead": segment_name(dead_pid(), host), "own": segment_name(os.getpid(), host),
             "live": segment_name(os.getppid(), host), "other host": segment_name(dead_pid(), host + "x")}
    for name in names.values():
        (SHM_DIR / name).write_bytes(b"kv")
    try:
        assert sorted(reclaim_stale_segments(host)) == sorted([names["dead"], names["own"]])
        assert [(SHM_DIR / n).exists() for n in names.values()] == [False, False, True, True]
    finally:
        for name in names.values():
            (SHM_DIR / name).unlink(missing_ok=True)
