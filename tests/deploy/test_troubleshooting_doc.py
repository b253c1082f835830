"""docs/troubleshooting.md stays true to the code: README's "Deploy and operate" links it, each entry says what
to check (ferryctl, metrics, log events), the cause and what to do, and every log event it names is one a
service logs, every metric one a service defines, every ferryctl command one ferryctl takes, every flag one
of some ferry command, every gRPC service a health check may name one the protos define."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from tests.deploy.test_readme_claims import every_flag

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "troubleshooting.md").read_text()
ENTRIES = re.split(r"^## ", PAGE, flags=re.MULTILINE)[1:]
FIELDS = ("**Check**", "**Metrics**", "**Log events**", "**Cause**", "**Do**")
_NAME = r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+"
# An event is the first argument of a log call (`log.info("x", ...)`, `(log.debug if ... else log.info)("x", ...)`)
# or a library line's ferry name (`LibraryEvent("x", ...)`).
_LOGGED = re.compile(rf"""(?:\blog\.(?:debug|info|warning|error|exception|critical)|\)|\bLibraryEvent)\(\s*"({_NAME})\"""")


def field_text(field: str) -> str:
    """What the page says under `field` in every entry (up to the next field)."""
    pattern = re.compile(rf"^- {re.escape(field)}:(.*?)(?=^- \*\*|\Z)", re.MULTILINE | re.DOTALL)
    return "\n".join(match for entry in ENTRIES for match in pattern.findall(entry))


def logged_events() -> set[str]:
    return {event for path in (ROOT / "services").rglob("*.py") if "gen" not in path.parts
            for event in _LOGGED.findall(path.read_text())}


def defined_metrics() -> set[str]:
    return {m for path in (ROOT / "services").glob("*/metrics.py")
            for m in re.findall(r'"(ferry_[a-z0-9_]+)"', path.read_text())}


def test_readme_deploy_and_operate_links_the_page():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Deploy and operate\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL).group(1)
    assert "(docs/troubleshooting.md)" in section


def test_every_entry_says_what_to_check_the_cause_and_what_to_do():
    assert len(ENTRIES) >= 9
    lacking = [(entry.splitlines()[0], field) for entry in ENTRIES for field in FIELDS if f"- {field}:" not in entry]
    assert not lacking, f"entries without a field: {lacking}"


def test_every_log_event_named_is_logged():
    events = logged_events()
    assert {"startup_failed", "rpc_failed", "etcd_watch_reconnecting", "migration_failed"} <= events
    assert "num_cut" not in events  # a field, not an event
    named = set(re.findall(rf"`({_NAME})`", field_text("**Log events**")))
    assert len(named) > 30
    unknown = sorted(named - events)
    assert not unknown, f"docs/troubleshooting.md names log events no service logs: {unknown}"


def test_every_metric_named_is_defined():
    defined = defined_metrics()
    named = set(re.findall(r"\bferry_[a-z0-9_]*[a-z0-9]", PAGE))
    assert len(set(re.findall(r"\bferry_[a-z0-9_]*[a-z0-9]", field_text("**Metrics**")))) > 15
    unknown = sorted(name for name in named if not {name, re.sub(r"_(total|bucket|sum|count)$", "", name)} & defined)
    assert not unknown, f"docs/troubleshooting.md names metrics no service defines: {unknown}"


def test_every_flag_named_is_a_flag_of_something():
    unknown = sorted(set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", PAGE)) - every_flag())
    assert not unknown, f"docs/troubleshooting.md names flags no ferry command takes: {unknown}"


def test_every_ferryctl_command_parses():
    from services.ctl.__main__ import build_parser
    commands = [args for span in re.findall(r"`([^`]+)`", PAGE.replace("\n  ", " "))
                for args in re.findall(r"\bferryctl((?: +[^\s`]+)+)", span)]
    assert len(commands) > 15
    refused = []
    for args in commands:
        try:
            build_parser().parse_args(shlex.split(args))
        except SystemExit:
            refused.append(args)
    assert not refused, f"docs/troubleshooting.md quotes ferryctl commands ferryctl refuses: {refused}"


def test_every_health_check_names_a_real_service():
    from services.common.gen.ferry.v1 import instance_pb2, manager_pb2, transfer_pb2
    services = {service.full_name for module in (instance_pb2, manager_pb2, transfer_pb2)
                for service in module.DESCRIPTOR.services_by_name.values()}
    named = re.findall(r"services\.ctl\.healthcheck [^`]*--service\s+([\w.]+)", PAGE)
    assert len(named) >= 2 and set(named) <= services, named
