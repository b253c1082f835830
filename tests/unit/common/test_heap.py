"""keep_freed_heap: big buffers allocated and freed in turn stop faulting in fresh pages."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from services.common import heap

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(heap._mallopt() is None, reason="needs glibc's mallopt (Linux with glibc)")]

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
MESSAGE_BYTES = 8 << 20
PAGES_PER_MESSAGE = MESSAGE_BYTES // 4096
ROUNDS = 20

# Each round allocates a message a page larger than the last (as grpc's messages differ a
# little in size) and writes all of it, as a received or gathered message is written.
_ROUNDS_SCRIPT = f"""
import resource, sys
from services.common.heap import keep_freed_heap
print(keep_freed_heap(int(sys.argv[1])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range({ROUNDS}):
    message = b"\\1" * ({MESSAGE_BYTES} + i * 4096)
    del message
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults_of_rounds(keep_bytes: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS_SCRIPT, str(keep_bytes)], capture_output=True, text=True,
                         check=True, timeout=30, cwd=REPO_ROOT).stdout.split()
    return out[0] == "True", int(out[1])


def test_with_the_heap_kept_messages_reuse_their_pages():
    is_set, faults = _page_faults_of_rounds(256 << 20)
    assert is_set
    assert faults < 3 * PAGES_PER_MESSAGE  # the first message's pages, then reuse


def test_with_glibcs_defaults_every_message_faults_in_fresh_pages():
    """The measure itself: without the setting the same rounds fault every page, every round."""
    is_set, faults = _page_faults_of_rounds(0)
    assert not is_set
    assert faults > ROUNDS // 2 * PAGES_PER_MESSAGE
