"""etcd3aio's lines as ferry's events (library_logs.py), through setup_logging's JSON lines (no sockets)."""

from __future__ import annotations

import importlib
import inspect
import json
import logging

import pytest
import structlog

from services.common.library_logs import LIBRARY_EVENTS
from services.common.logging import LogFormat, setup_logging

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def json_lines(capsys):
    """(start: setup_logging("demo", JSON), called in the test, where capsys's stderr is the test's own;
    lines: the lines on stderr since, parsed)."""
    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    try:
        yield lambda: setup_logging("demo", LogFormat.JSON, "info"), lambda: _parsed(capsys.readouterr().err)
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = root_handlers
        logging.getLogger().setLevel(root_level)


def _parsed(err: str) -> list[dict]:
    return [json.loads(line) for line in err.strip().splitlines()]


def test_etcd3aios_watch_reconnect_is_a_snake_case_event_with_fields(json_lines) -> None:
    """Before, the event was the sentence `watch: transient error (UNAVAILABLE), reconnecting in 0.50 s`."""
    start, lines = json_lines
    start()
    logging.getLogger("etcd3aio.watch").warning("watch: transient error (%s), reconnecting in %.2f s",
                                                "UNAVAILABLE", 0.5)  # as etcd3aio/watch.py calls it
    (line,) = lines()
    assert {k: line[k] for k in ("event", "code", "retry_in_s", "logger", "level", "service")} == {
        "event": "etcd_watch_reconnecting", "code": "UNAVAILABLE", "retry_in_s": 0.5, "logger": "etcd3aio.watch",
        "level": "warning", "service": "demo"}


def test_a_lease_keepalive_failure_names_the_lease_in_hex(json_lines) -> None:
    start, lines = json_lines
    start()
    logging.getLogger("etcd3aio.lease").warning("lease-keepalive: request failed for lease %d (%s)", 0x5a, "CANCELLED")
    (line,) = lines()
    assert (line["event"], line["lease_id"], line["code"]) == ("etcd_lease_keepalive_failed", "5a", "CANCELLED")


def test_any_other_library_line_keeps_its_message_on_one_line(json_lines) -> None:
    start, lines = json_lines
    start()
    logging.getLogger("grpc").warning("channel %s closed", "x")
    logging.getLogger("etcd3aio.lease").warning("lease-keepalive: request failed for lease %d (%s)", 1.5, "X")
    assert [(e["event"], e["logger"]) for e in lines()] == [
        ("channel x closed", "grpc"), ("lease-keepalive: request failed for lease 1 (X)", "etcd3aio.lease")]


@pytest.mark.parametrize("logger, message", list(LIBRARY_EVENTS))
def test_each_known_line_is_still_the_librarys(logger: str, message: str) -> None:
    """An etcd3aio upgrade that rewords a line would leave it a sentence again: this says so."""
    assert f"'{message}'" in inspect.getsource(importlib.import_module(logger))
