"""The lines libraries log through stdlib `logging` that ferry knows, as ferry's own events.

etcd3aio says `watch: transient error (UNAVAILABLE), reconnecting in 0.50 s`: an English sentence
where every ferry line is a snake_case event with fields. Each line below is matched by its
logger and format string and becomes its event, its %-arguments its fields (the `logger` field
still names the library). Any other library line keeps its message as the event, one line too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LibraryEvent:
    event: str  # ferry's name for the line
    fields: Callable[..., dict[str, Any]]  # the line's %-arguments as fields


# (logger, format string) -> event; tests check that each format string is still the library's
LIBRARY_EVENTS: dict[tuple[str, str], LibraryEvent] = {
    ("etcd3aio.watch", "watch: transient error (%s), reconnecting in %.2f s"): LibraryEvent(
        "etcd_watch_reconnecting", lambda code, delay_s: {"code": code, "retry_in_s": round(delay_s, 2)}),
    ("etcd3aio.lease", "lease-keepalive: request failed for lease %d (%s)"): LibraryEvent(
        "etcd_lease_keepalive_failed", lambda lease_id, code: {"lease_id": f"{lease_id:x}", "code": code}),
    ("etcd3aio.auth", "token-refresher: re-authentication failed"): LibraryEvent(
        "etcd_reauthentication_failed", lambda: {}),
}


def structure_library_line(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor for stdlib records (ProcessorFormatter's foreign chain, with
    `pass_foreign_args`): a known line becomes its event and fields."""
    args = event.pop("positional_args", ())
    record: logging.LogRecord | None = event.get("_record")
    known = LIBRARY_EVENTS.get((record.name, record.msg)) if record is not None and isinstance(record.msg, str) else None
    if known is None or not isinstance(args, tuple):
        return event
    try:
        fields = known.fields(*args)
    except (TypeError, ValueError):  # the library called it with other arguments: its message stays
        return event
    return {**event, **fields, "event": known.event}
