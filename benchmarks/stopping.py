"""SIGTERM (what `timeout` and `kill` send) stops a benchmark as Ctrl-C does.

Without a handler the process dies at once: services it started in sessions of their own
(transfer services, instances) run on for good and its shared memory stays. Raising
KeyboardInterrupt from the handler is not enough either: it lands in whatever frame runs,
and one inside a `__del__` is swallowed ("Exception ignored in"). SIGINT inside
`asyncio.run` cancels the main task instead (so every `finally` runs, with awaits), and
outside it raises KeyboardInterrupt, so the handler sends the process a SIGINT. That one
cancel can be lost (a call that swallows CancelledError): a long loop also calls
`raise_if_stopping()` at each step, which raises KeyboardInterrupt once SIGTERM came.

    signal.signal(signal.SIGTERM, as_ctrl_c)
"""

from __future__ import annotations

import signal


_stopping = False  # SIGTERM came


def as_ctrl_c(_signum: int, _frame: object) -> None:
    global _stopping
    _stopping = True
    signal.raise_signal(signal.SIGINT)


def raise_if_stopping() -> None:
    """A long loop's check point: KeyboardInterrupt once SIGTERM came, even if the cancel it made was lost."""
    if _stopping:
        raise KeyboardInterrupt
