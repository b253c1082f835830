"""SIGTERM (what `timeout` and `kill` send) stops a benchmark as Ctrl-C does.

Without a handler the process dies at once: services it started in sessions of their own
(transfer services, instances) run on for good and its shared memory stays. Raising
KeyboardInterrupt from the handler is not enough either: it lands in whatever frame runs,
and one inside a `__del__` is swallowed ("Exception ignored in"). SIGINT inside
`asyncio.run` cancels the main task instead (so every `finally` runs, with awaits), and
outside it raises KeyboardInterrupt, so the handler sends the process a SIGINT.

    signal.signal(signal.SIGTERM, as_ctrl_c)
"""

from __future__ import annotations

import signal


def as_ctrl_c(_signum: int, _frame: object) -> None:
    signal.raise_signal(signal.SIGINT)
