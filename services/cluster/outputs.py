"""The launcher's stdout and stderr, made so that writing to them never fails.

They go away while the launcher still has work to do: closing its terminal hangs it up (every
write then fails with EIO) and Ctrl-C on `up 2>&1 | tee cluster.log` ends tee too (EPIPE). The
launcher logs each child it stops; had that raised, the stop would end at its first line and
leave the children to the kernel's SIGKILL (PR_SET_PDEATHSIG), cluster.json behind.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO


class ForgivingStream:
    """A text stream whose write and flush never raise: once the file behind it fails, its
    descriptor points at /dev/null, and what is still written goes nowhere."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._discard_from_now_on()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._discard_from_now_on()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _discard_from_now_on(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # no descriptor of its own (a test's capture)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)


def forgive_broken_outputs() -> None:
    """Wrap sys.stdout and sys.stderr; before logging is set up, which keeps the stream it is given."""
    sys.stdout = ForgivingStream(sys.stdout)
    sys.stderr = ForgivingStream(sys.stderr)
