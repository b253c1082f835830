"""How a service process starts, and how it fails to.

`run_service` runs a service's main. A `StartupError` (a model folder that is not one, a port
that is taken, a KV cache that does not fit) or a ferry error escaping main (etcd not
answering at registration) ends the process with one log line that names the problem and
exit status 1, instead of a traceback: the message is what an operator reads in the journal.
Anything else escaping main is a bug and keeps its traceback.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Coroutine
from typing import Any

import structlog
from prometheus_client import disable_created_metrics, start_http_server

from services.common.error_text import error_text
from services.common.errors import FerryError
from services.common.teardown_noise import install_exception_handler

log = structlog.get_logger(__name__)


class StartupError(Exception):
    """The service cannot start as configured; the message says which flag or resource to fix."""


class StoppedBeforeReady(Exception):
    """SIGINT/SIGTERM came while the service was still waiting to start (for etcd): it exits 0."""


def run_service(main: Coroutine[Any, Any, None]) -> None:
    freeze_imported_objects()
    try:
        asyncio.run(_quiet_about_watch_teardown(main))
    except Exception as exc:  # noqa: BLE001 — re-raised unless it is a failure we can name
        if _is_stopped_before_ready(exc):
            log.info("stopped_before_ready")
            return
        failure = _named_failure(exc)
        if failure is None:
            raise
        if isinstance(failure, StartupError):
            log.error("startup_failed", error=error_text(failure))
        else:
            log.error("service_failed", code=failure.grpc_code.name, error=failure.message)
        sys.exit(1)


def freeze_imported_objects() -> None:
    """Keep what the imports made (torch's and grpc's modules, hundreds of thousands of objects that live as
    long as the process) out of the garbage collector's full passes: each walked them all and held the event
    loop some 80-90 ms (seen in a transfer service during a transfer; with them frozen, its longest loop wait
    fell from 87 to 27 ms). Objects made later are collected as before."""
    gc.collect()
    gc.freeze()


async def _quiet_about_watch_teardown(main: Coroutine[Any, Any, None]) -> None:
    install_exception_handler()
    await main


def _named_failure(exc: BaseException) -> StartupError | FerryError | None:
    """`exc`, or the first failure inside a task group's exception group, when every failure is one."""
    if isinstance(exc, (StartupError, FerryError)):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        failures = [_named_failure(inner) for inner in exc.exceptions]
        return failures[0] if failures and all(f is not None for f in failures) else None
    return None


def _is_stopped_before_ready(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return bool(exc.exceptions) and all(_is_stopped_before_ready(inner) for inner in exc.exceptions)
    return isinstance(exc, StoppedBeforeReady)


def drop_created_series() -> None:
    """No `*_created` series: prometheus_client adds one per counter and histogram child (its creation
    time), doubling the series count for nothing a ferry panel or alert reads. Process-wide; every
    service calls it where it sets up its metrics."""
    disable_created_metrics()


def start_metrics_server(port: int, host: str = "0.0.0.0") -> None:
    """Serve Prometheus' /metrics on a daemon thread; StartupError if the port is taken."""
    drop_created_series()
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise StartupError(f"--metrics-port {port}: cannot serve /metrics on {host}: {exc.strerror or exc}; "
                           "pick another --metrics-port (or --metrics-host)") from None
