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

`logs_kept_on_failure` ends such a run: one line naming the logs kept, or the folder gone.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import sys
from collections.abc import Iterator

from services.cluster.processes import ProcessDied


_stopping = False  # SIGTERM came


def as_ctrl_c(_signum: int, _frame: object) -> None:
    global _stopping
    _stopping = True
    signal.raise_signal(signal.SIGINT)


def raise_if_stopping() -> None:
    """A long loop's check point: KeyboardInterrupt once SIGTERM came, even if the cancel it made was lost."""
    if _stopping:
        raise KeyboardInterrupt


@contextlib.contextmanager
def logs_kept_on_failure(script: str, logs: pathlib.Path, folder: pathlib.Path, keep: bool = False) -> Iterator[None]:
    """A run whose services log under `logs` (in the temporary `folder`): Ctrl-C, SIGTERM or a service that
    died end it with one line naming the kept logs (exit 1), any other failure names them before its
    traceback, and a run that succeeded removes `folder` (unless `keep`)."""
    try:
        yield
    except ProcessDied as exc:
        raise SystemExit(f"{script}: {exc}\n(logs kept in {logs})") from None
    except KeyboardInterrupt:
        raise SystemExit(f"{script}: interrupted (services stopped; logs kept in {logs})") from None
    except BaseException:
        print(f"{script}: logs kept in {logs}", file=sys.stderr)
        raise
    if not keep:
        shutil.rmtree(folder)
