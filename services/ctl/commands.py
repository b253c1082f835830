"""One coroutine per ferryctl subcommand: call the admin API, return what to print.

Each returns `(record, text)`: the record for --json, the text for a terminal.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from services.ctl.client import AdminClient
from services.ctl.tables import (drain_line, instances_table, migrate_table, requests_table, status_table)

Output = tuple[Any, str]
Command = Callable[[AdminClient, argparse.Namespace], Awaitable[Output]]


async def instances(client: AdminClient, args: argparse.Namespace) -> Output:
    rows = await client.list_instances()
    return rows, instances_table(rows)


async def requests(client: AdminClient, args: argparse.Namespace) -> Output:
    listing = await client.list_requests(args.instance or "")
    return listing, requests_table(listing)


async def status(client: AdminClient, args: argparse.Namespace) -> Output:
    cluster = await client.cluster_status()
    return cluster, status_table(cluster)


async def policy(client: AdminClient, args: argparse.Namespace) -> Output:
    if args.action == "set":
        dispatch = await client.set_policy(args.dispatch)
        return {"dispatch": dispatch}, f"dispatch policy is now {dispatch}"
    dispatch = await client.get_policy()
    return {"dispatch": dispatch}, f"dispatch policy: {dispatch}"


async def drain(client: AdminClient, args: argparse.Namespace) -> Output:
    result = await client.drain(args.instance_id)
    return result, drain_line(result)


async def migrate(client: AdminClient, args: argparse.Namespace) -> Output:
    result = await client.migrate(args.request or "", args.src or "", args.dst or "")
    return result, migrate_table(result)


async def role(client: AdminClient, args: argparse.Namespace) -> Output:
    new_role = await client.set_role(args.instance_id, args.role)
    return {"instance_id": args.instance_id, "role": new_role}, f"instance {args.instance_id} is now {new_role}"


COMMANDS: dict[str, Command] = {
    "instances": instances, "requests": requests, "status": status, "policy": policy, "drain": drain,
    "migrate": migrate, "role": role,
}
