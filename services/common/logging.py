"""Logging setup: structlog for ferry code, the same renderer for stdlib loggers (grpc, etcd3aio),
whose lines ferry knows become its events (library_logs.py).

Events are snake_case past-tense facts with fields. `service` is on every line;
`request_id` is on every line logged while a gRPC call runs, bound by
`RequestIdInterceptor` from the `x-request-id` metadata key, and forwarded by clients
with `request_metadata(request_id)`.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from services.common.config import knob
from services.common.library_logs import structure_library_line
from services.common.rpc_handler import Behavior, is_streaming_behavior, wrap_rpc_handler
from services.common.sd_notify import notify_systemd

REQUEST_ID_KEY = "x-request-id"

Processor = Callable[[Any, str, dict[str, Any]], Any]


class LogFormat(enum.Enum):
    CONSOLE = "console"  # coloured key=value lines, for humans
    JSON = "json"  # one JSON object per line, for deploys


class LogLevel(enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclasses.dataclass(frozen=True)
class LogKnobs:
    """Logging flags of a service (mixed into its config dataclass); checked when the flags are parsed."""

    log_format: LogFormat = knob(LogFormat.CONSOLE, "log format: console (key=value lines, for humans) or json "
                                                    "(one object per line, for log shippers)")
    log_level: LogLevel = knob(LogLevel.INFO, "least severe level logged: debug, info, warning, error or critical")

    def setup_logging(self, service: str) -> None:
        setup_logging(service, self.log_format, self.log_level.value)

    def print_ready(self, member_id: str, address: str) -> None:
        """The line on stdout that says this process serves (`ready <id> <address>`, what harnesses
        wait for); with --log-format json a JSON object with the level and timestamp every other
        line has, so a journal of JSON lines stays one a log shipper can read throughout."""
        if self.log_format is LogFormat.JSON:
            timestamp = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
            print(json.dumps({"event": "ready", "id": member_id, "address": address, "level": "info",
                              "timestamp": timestamp}), flush=True)
        else:
            print(f"ready {member_id} {address}", flush=True)
        notify_systemd("READY=1")  # a Type=notify unit counts as started from here


def setup_logging(service: str, fmt: LogFormat = LogFormat.CONSOLE, level: str = "info") -> None:
    """Configure structlog and the stdlib root logger once, at process start."""
    level_no = logging.getLevelNamesMapping().get(level.upper())
    if level_no is None:
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error, critical")
    shared = _shared_processors(service)
    renderer = _renderer(fmt)
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), _exc_formatter(fmt), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging([*shared, _exc_formatter(fmt)], renderer, level_no)


def request_metadata(request_id: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that forwards `request_id` to the next service (empty if None)."""
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()


def request_id_from_metadata(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Binds `request_id` from the `x-request-id` metadata into structlog contextvars for the call."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        request_id = request_id_from_metadata(handler_call_details.invocation_metadata)
        if request_id is None:
            return handler
        return wrap_rpc_handler(handler, lambda behavior: _bind_request_id(behavior, request_id))


def _bind_request_id(behavior: Behavior, request_id: str) -> Behavior:
    if is_streaming_behavior(behavior):
        async def stream_with_request_id(request, context):
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                async for response in behavior(request, context):
                    yield response
        return stream_with_request_id

    async def call_with_request_id(request, context):
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            return await behavior(request, context)
    return call_with_request_id


def _shared_processors(service: str) -> list[Processor]:
    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_service,
    ]


def _renderer(fmt: LogFormat) -> Processor:
    if fmt is LogFormat.JSON:
        return structlog.processors.JSONRenderer()
    # Plain tracebacks: rich's (the default where rich is installed) print every frame's local
    # variables, and a frame holding a large request body printed it once a frame, for minutes.
    return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)


def _exc_formatter(fmt: LogFormat) -> Processor:
    # The console renderer prints tracebacks itself; JSON needs them as a string field.
    if fmt is LogFormat.JSON:
        return structlog.processors.format_exc_info
    return lambda _logger, _method, event: event


def _route_stdlib_logging(shared: list[Processor], renderer: Processor, level_no: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structure_library_line, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        pass_foreign_args=True,  # for structure_library_line, which takes them out again
    ))
    if level_no > logging.DEBUG:
        handler.addFilter(_is_not_client_gone_noise)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)


def _is_not_client_gone_noise(record: logging.LogRecord) -> bool:
    """False for gRPC's ERROR with a traceback when a stream's final status could not be sent because
    its client had already closed it (ExecuteBatchError on SendStatusFromServerOperation): nothing failed."""
    if record.name != "grpc._cython.cygrpc" or not record.exc_info or record.exc_info[0] is None:
        return True
    return not (record.exc_info[0].__name__ == "ExecuteBatchError"
                and "SendStatusFromServerOperation" in str(record.exc_info[1]))
