"""A role set at runtime (`SetRole`) outlives restarts of the instance, as a drain mark does.

`config/roles/<instance id>` (no lease) holds {"instance_id", "role", "command_line_role",
"set_at"}. An instance that starts again with the same `--role` takes the stored role back
(the launcher or systemd restarting a crashed one); one started with another `--role` means
an operator changed its command line since, and the command line wins: the mark goes.
Setting the role back to the command line's removes the mark too.

A mark that cannot be written (etcd away) is logged and the role changes here all the same:
only a restart before the next `SetRole` would lose it.
"""

from __future__ import annotations

import time

import structlog

from services.common.errors import Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.registry import Registry
from services.instance.config import InstanceRole

log = structlog.get_logger(__name__)

ROLE_MARKS = "config/roles"  # `config/roles/<instance id>`: a role set at runtime


def role_mark_key(instance_id: str) -> str:
    return f"{ROLE_MARKS}/{instance_id}"


async def restored_role(registry: Registry, instance_id: str, command_line_role: InstanceRole) -> InstanceRole:
    """The role this instance starts with: its stored mark's, if that was set over this same `--role`."""
    key = role_mark_key(instance_id)
    try:
        mark = await registry.get_json(key)
    except (Unavailable, *ETCD_ERRORS, ValueError) as exc:  # ValueError: not JSON; left for an operator
        log.warning("role_mark_unread", instance_id=instance_id, role=command_line_role.value,
                    error=str(exc) or type(exc).__name__)
        return command_line_role
    if mark is None:
        return command_line_role
    stored = _parse(mark)
    if stored is None:
        log.warning("role_mark_ignored", instance_id=instance_id, mark=mark, role=command_line_role.value)
        return command_line_role
    role, set_over = stored
    if set_over is not command_line_role:
        log.info("role_mark_dropped", instance_id=instance_id, role=command_line_role.value, stored_role=role.value,
                 reason=f"--role is now {command_line_role.value}, the mark was set over {set_over.value}")
        await _delete(registry, instance_id)
        return command_line_role
    log.info("instance_role_restored", instance_id=instance_id, role=role.value,
             command_line_role=command_line_role.value)
    return role


async def keep_role(registry: Registry, instance_id: str, role: InstanceRole,
                    command_line_role: InstanceRole) -> None:
    """Store a role set at runtime (or remove the mark, when it is the command line's role again)."""
    if role is command_line_role:
        await _delete(registry, instance_id)
        return
    mark = {"instance_id": instance_id, "role": role.value, "command_line_role": command_line_role.value,
            "set_at": time.time()}
    try:
        await registry.put_json(role_mark_key(instance_id), mark)
    except (Unavailable, *ETCD_ERRORS) as exc:
        log.warning("role_mark_not_written", instance_id=instance_id, role=role.value,
                    error=str(exc) or type(exc).__name__)


async def _delete(registry: Registry, instance_id: str) -> None:
    try:
        await registry.delete_json_if(role_mark_key(instance_id), lambda _mark: True)
    except (Unavailable, *ETCD_ERRORS) as exc:
        log.warning("role_mark_not_removed", instance_id=instance_id, error=str(exc) or type(exc).__name__)


def _parse(mark: object) -> tuple[InstanceRole, InstanceRole] | None:
    """(role, command line role it was set over), or None if the mark is not one."""
    if not isinstance(mark, dict):
        return None
    try:
        return InstanceRole(mark.get("role")), InstanceRole(mark.get("command_line_role"))
    except ValueError:
        return None
