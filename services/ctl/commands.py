"""One coroutine per ferryctl subcommand: call the admin API, return what to print.

Each returns `(record, text)`: the record for --json, the text for a terminal; or `(record, text, note)`,
where `note` is a caveat that --json prints on stderr (the text has it already).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

from services.ctl.client import AdminClient
from services.ctl.tables import (drain_line, listing_table, migrate_table, migrations_table, policy_table,
                                requests_table, status_table, view_note)

Output = tuple[Any, str] | tuple[Any, str, str]
Command = Callable[[AdminClient, argparse.Namespace], Awaitable[Output]]


async def instances(client: AdminClient, args: argparse.Namespace) -> Output:
    listing = await client.instance_listing()
    rows, text = list(listing.rows), listing_table(listing)
    return (rows, text) if listing.is_leaders_view else (rows, text, view_note(listing))


async def requests(client: AdminClient, args: argparse.Namespace) -> Output:
    listing = await client.list_requests(args.instance or "")
    return listing, requests_table(listing)


async def status(client: AdminClient, args: argparse.Namespace) -> Output:
    cluster = await client.cluster_status()
    num_unreported = sum(not row.has_report for row in await client.list_instances())
    return cluster, status_table(cluster, num_unreported)


async def policy(client: AdminClient, args: argparse.Namespace) -> Output:
    if args.action == "set":
        fields = dict(parse_assignment(item) for item in args.set or ())
        if args.dispatch:
            fields["dispatch"] = args.dispatch
        if not fields:
            raise ValueError("policy set: give a dispatch policy and/or --set FIELD=VALUE")
        current = await client.set_policy(fields)
    else:
        current = await client.get_policy()
    return current, policy_table(current)


# Names an operator sees elsewhere for a policy field: `status` and the manager flag say dispatch_policy.
FIELD_ALIASES = {"dispatch_policy": "dispatch"}


def parse_assignment(item: str) -> tuple[str, object]:
    """`migration_threshold=8` -> ("migration_threshold", 8); JSON values where they parse, else text."""
    name, has_value, raw = item.partition("=")
    if not has_value or not name:
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set migration_enabled=true")
    name = FIELD_ALIASES.get(name.strip(), name.strip())
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


async def drain(client: AdminClient, args: argparse.Namespace) -> Output:
    result = await client.drain(args.instance_id, undo=args.undo)
    return result, drain_line(result)


async def migrate(client: AdminClient, args: argparse.Namespace) -> Output:
    result = await client.migrate(args.request or "", args.src or "", args.dst or "")
    return result, migrate_table(result)


async def migrations(client: AdminClient, args: argparse.Namespace) -> Output:
    rows = await client.list_migrations(args.instance or "", args.request or "")
    text = migrations_table(rows)
    if not rows and args.instance and args.instance not in {i.instance_id for i in await client.list_instances()}:
        text += f" (and no instance {args.instance} is registered now; the history keeps instances that are gone)"
    return rows, text


async def role(client: AdminClient, args: argparse.Namespace) -> Output:
    new_role = await client.set_role(args.instance_id, args.role)
    return {"instance_id": args.instance_id, "role": new_role}, f"instance {args.instance_id} is now {new_role}"


COMMANDS: dict[str, Command] = {
    "instances": instances, "requests": requests, "status": status, "policy": policy, "drain": drain,
    "migrate": migrate, "migrations": migrations, "role": role,
}
