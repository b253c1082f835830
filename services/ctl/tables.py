"""Plain-text tables for ferryctl: aligned columns, numbers right-aligned, no colours."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from services.ctl.records import (ClusterStatus, DrainResult, InstanceListing, InstanceRow, MigrateResult, MigrationRow,
                                 RequestList)

_BAR_WIDTH = 10
UNKNOWN = "?"  # a cell whose figure the answering manager does not have
NOT_MEASURED = "-"  # a rate with one sample so far (the first frame of `top`)
MESSAGE_CHARS = 100  # a migration's message in `migrations` (the whole of it: --json)
FIGURE_TEXT = re.compile(r"-?\d+(\.\d+)?%|(\d+|\?)/\d+")  # a share (`12.5%`) or a count of a total (`7/64`, `?/64`)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numeric columns right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [bool(rows) and all(_is_figure(row[i]) for row in rows) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [c.rjust(w) if is_num else c.ljust(w) for c, w, is_num in zip(row, widths, numeric, strict=True)]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _is_figure(value: object) -> bool:
    """A cell that reads as a number (right-aligned, digits under digits)."""
    return (isinstance(value, (int, float)) or value in (UNKNOWN, NOT_MEASURED)
            or (isinstance(value, str) and FIGURE_TEXT.fullmatch(value) is not None))


def instances_table(rows: Sequence[InstanceRow]) -> str:
    """One line per instance, within 120 columns for ids like `instance-12`, IPv4 addresses and host names of up
    to 10 characters; a HOST column (before ADDRESS) only when the instances sit on more than one host."""
    if not rows:
        return "no instances registered"
    hosts = host_names(rows)
    headers = ("INSTANCE", "ROLE", "STATE", "RUN", "WAIT", "SLOTS", "KV FREE", "FREENESS", "SERVED", "PREEMPT",
               "CACHE HIT", *(("HOST",) if hosts else ()), "ADDRESS")
    return render_table(headers, [
        (r.instance_id, r.role, r.shown_state, _load(r, r.num_running), _load(r, r.num_waiting), r.slots,
         f"{_load(r, r.num_free_blocks)}/{r.num_total_blocks}", _load(r, r.freeness), _load(r, r.num_requests_served),
         _load(r, r.num_preemptions), _load(r, f"{r.prefix_cache_hit_rate:.1%}"), *(hosts[i:i + 1]), r.address)
        for i, r in enumerate(rows)])


def host_names(rows: Sequence[InstanceRow]) -> list[str]:
    """Each row's host as the HOST column shows it, or [] where they all sit on one host (the column would repeat
    one name). Names are cut at their first dot (`hostname -s`) unless that makes two hosts look alike; `?` for an
    instance that does not say (an older one)."""
    full = [r.host or UNKNOWN for r in rows]
    if len(set(full) - {UNKNOWN}) < 2:
        return []
    short = [name if _is_ipv4(name) else name.split(".", 1)[0] for name in full]
    return short if len(set(short)) == len(set(full)) else full


def _is_ipv4(name: str) -> bool:
    return name.replace(".", "").isdigit()


def listing_table(listing: InstanceListing) -> str:
    """`instances`: the table, and below it, where the view is not the leader's, why the instances show unhealthy."""
    return "\n".join([instances_table(listing.rows), *([view_note(listing)] if not listing.is_leaders_view else [])])


def view_note(listing: InstanceListing | ClusterStatus) -> str:
    """Whose view an answer that is not the leader's is, and what it is worth."""
    if not listing.leader_id:
        return f"no leader: {leaderless_view(listing.answered_by)}"
    return (f"not the leader's view: {listing.answered_by} answered alone (the leader, {listing.leader_id}, did not "
            "in time) and gets no load reports, so it counts instances as unhealthy that may well serve")


def leaderless_view(answered_by: str) -> str:
    """What the view of `answered_by`, a manager that answered while no manager leads, is worth."""
    return (f"{answered_by}'s view: no load reports reach it, so it counts instances as unhealthy that may well "
            "serve (etcd unreachable, or an election under way; frontends place requests themselves meanwhile)")


def load_table(rows: Sequence[InstanceRow], served_per_s: dict[str, float],
               preempted_per_s: dict[str, float] | None = None) -> str:
    """The `top` view: a KV usage bar, throughput and preemptions (KV pressure) per instance (`-` where no rate is
    measured yet: the first frame, so the snapshot of `top --iterations 1`, had 0.00 for a busy instance)."""
    if not rows:
        return "no instances registered"
    preempted_per_s = preempted_per_s or {}
    headers = ("INSTANCE", "ROLE", "STATE", "RUN", "WAIT", "SLOTS", "KV USED", "", "FREENESS", "REQ/S", "PREEMPT/S",
               "SERVED", "REPORT AGE")
    return render_table(headers, [
        (r.instance_id, r.role, r.shown_state, _load(r, r.num_running), _load(r, r.num_waiting), r.slots,
         _load(r, _bar(r.kv_used_fraction)), _load(r, f"{r.kv_used_fraction:.1%}"), _load(r, r.freeness),
         _load(r, served_per_s.get(r.instance_id, NOT_MEASURED)),
         _load(r, preempted_per_s.get(r.instance_id, NOT_MEASURED)), _load(r, r.num_requests_served),
         _age(r.report_age_s))
        for r in rows])


def requests_table(listing: RequestList) -> str:
    lines = []
    if listing.requests:
        lines.append(render_table(("REQUEST", "INSTANCE", "STATE", "TOKENS", "OUTPUT TOKENS"), [
            (r.request_id, r.instance_id, r.state, r.num_tokens, r.num_output_tokens) for r in listing.requests]))
    else:
        lines.append("no requests")
    if listing.unreachable_instance_ids:
        lines.append(f"(no answer from: {', '.join(listing.unreachable_instance_ids)})")
    return "\n".join(lines)


def status_table(status: ClusterStatus, num_unreported: int = 0) -> str:
    """`num_unreported`: instances whose load the answering manager has not heard yet (ListInstances)."""
    leader = f"{status.leader_id} ({status.leader_address})" if status.leader_id else "none elected"
    unreported = [("load unknown", f"{_count(num_unreported, 'instance')} not reported to {status.answered_by} yet: "
                                   "the figures above count them as idle")] if num_unreported else []
    leaderless = [] if status.leader_id else [("no leader", leaderless_view(status.answered_by))]
    return render_table(("", ""), [
        ("leader", leader),
        ("answered by", status.answered_by),
        ("dispatch policy", status.dispatch_policy),
        ("instances", f"{status.num_instances} ({status.num_serving} serving, {status.num_draining} draining, "
                      f"{status.num_unhealthy} unhealthy)"),
        ("requests", f"{status.num_running} running, {status.num_waiting} waiting"),
        ("dispatched", str(status.num_dispatched)),
        ("average freeness", f"{status.average_freeness:.1f}"),
        *unreported,
        *leaderless,
    ]).split("\n", 1)[1]


def drain_line(result: DrainResult) -> str:
    if result.state == "unspecified":  # Undrain of an instance that is not registered: only its mark went
        return (f"instance {result.instance_id} is not registered; its drain mark is removed, so it takes "
                "requests when it comes back under this id")
    if result.state == "serving":
        return f"instance {result.instance_id} is serving: new requests reach it again"
    if result.is_drained:
        return f"instance {result.instance_id} is drained: no new requests go to it, and nothing runs there"
    remaining = f"; {_count(result.num_remaining, 'request')} still on it" if result.num_remaining else ""
    return f"instance {result.instance_id} is {result.state}: no new requests go to it{remaining}"


def policy_table(policy: dict[str, object]) -> str:
    return "\n".join(line.rstrip() for line in render_table(("", ""), [
        (name, _value(value)) for name, value in policy.items()]).splitlines()[1:])


def migrations_table(rows: Sequence[MigrationRow]) -> str:
    if not rows:
        return "no migrations"
    return render_table(("STARTED", "REQUEST", "FROM", "TO", "TRIGGER", "OUTCOME", "BLOCKS", "STAGES", "BACKEND",
                         "DURATION MS", "DOWNTIME MS", "REASON", "MESSAGE"), [
        (time.strftime("%H:%M:%S", time.localtime(r.started_at)), r.request_id or "-", r.src_instance_id,
         r.dst_instance_id, r.trigger, r.outcome, r.num_blocks, r.num_stages, r.backend, r.duration_ms,
         r.downtime_ms, r.reason, _why(r)) for r in rows])


def _why(row: MigrationRow) -> str:
    """What went wrong, shortened (the whole message is in --json); nothing for a committed migration."""
    if row.outcome == "committed" or not row.message:
        return ""
    return row.message if len(row.message) <= MESSAGE_CHARS else row.message[:MESSAGE_CHARS - 3] + "..."


def migrate_table(result: MigrateResult) -> str:
    return render_table(("REQUEST", "FROM", "TO", "BLOCKS", "CACHED", "BYTES", "STAGES", "BACKEND", "DURATION MS",
                         "DOWNTIME MS"), [
        (result.request_id, result.src_instance_id, result.dst_instance_id, result.num_blocks,
         result.num_cached_at_destination, result.num_bytes, result.num_stages, result.backend, result.duration_ms,
         result.downtime_ms)])


def _load(row: InstanceRow, value: object) -> object:
    """`value`, or `?` while the answering manager has no load report of `row`: its zeros would show a
    busy instance as idle (for a second or two after a leader change, the whole cluster)."""
    return value if row.has_report else UNKNOWN


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * _BAR_WIDTH)
    return "[" + "#" * filled + "." * (_BAR_WIDTH - filled) + "]"


def _age(report_age_s: float) -> str:
    return "no report" if report_age_s < 0 else f"{report_age_s:.1f}s"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
