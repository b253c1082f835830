"""Process signals: SIGINT/SIGTERM only set an event; `main()` does the shutdown."""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call from inside the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
