"""A role set at runtime (`SetRole`) outlives restarts of the instance, as a drain mark does.

`config/roles/<instance id>` (no lease) holds {"instance_id", "role", "command_line_role",
"set_at"}. An instance that starts again with the same `--role` takes the stored role back
(the launcher or systemd restarting a crashed one); one started with another `--role` means
an operator changed its command line since, and the command line wins: the mark goes.
Setting the role back to the command line's removes the mark too. The manager removes the
mark of an instance that left for good (a retirement), so a new instance under that id
starts with its own `--role`.

The mark follows the role like the instance's etcd record does: a write that fails (etcd
away) is tried again until etcd takes it, the newest role winning, while the role changes
here at once.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common.backoff import Backoff
from services.common.error_text import error_text
from services.common.errors import Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.registry import ROLE_MARKS, Registry
from services.instance.config import InstanceRole

log = structlog.get_logger(__name__)


def role_mark_key(instance_id: str) -> str:
    return f"{ROLE_MARKS}/{instance_id}"


class RoleMarks:
    """This instance's role mark: read once at start, then kept equal to the role set here."""

    def __init__(self, registry: Registry, instance_id: str, command_line_role: InstanceRole) -> None:
        self._registry = registry
        self._instance_id = instance_id
        self._command_line_role = command_line_role
        self._wanted: InstanceRole | None = None  # a role not written yet (None: all written)
        self._set_here: InstanceRole | None = None  # the role a SetRole kept: the mark is its, and it wins at start
        self._unwritten = asyncio.Event()
        self._lock = asyncio.Lock()

    async def restored_role(self) -> InstanceRole:
        """The role to start with: the stored mark's, if that was set over this same `--role`; but the role of a
        SetRole that came first (etcd away at start), whose mark is on its way, whatever the stored one says."""
        if self._set_here is not None:
            return self._set_here
        try:
            mark = await self._registry.get_json(role_mark_key(self._instance_id))
        except ValueError as exc:  # not JSON: left for an operator
            self._log_unread(exc)
            return self._command_line_role
        except (Unavailable, *ETCD_ERRORS) as exc:
            self._log_unread(exc)
            self._keep_later(self._command_line_role)  # it runs with its --role: a mark left would name another
            return self._command_line_role
        if mark is None:
            return self._command_line_role
        stored = _parse(mark)
        if stored is None:
            log.warning("role_mark_ignored", instance_id=self._instance_id, mark=mark,
                        role=self._command_line_role.value)
            return self._command_line_role
        role, set_over = stored
        if set_over is not self._command_line_role:
            log.info("role_mark_dropped", instance_id=self._instance_id, role=self._command_line_role.value,
                     stored_role=role.value, reason=f"--role is now {self._command_line_role.value}, the mark "
                                                    f"was set over {set_over.value}")
            await self.keep(self._command_line_role)
            return self._command_line_role
        log.info("instance_role_restored", instance_id=self._instance_id, role=role.value,
                 command_line_role=self._command_line_role.value)
        return role

    async def keep(self, role: InstanceRole) -> None:
        """Store a role set at runtime (remove the mark when it is the command line's role again); if
        etcd does not take it now, `write_loop` tries again."""
        self._set_here = role
        self._wanted = role
        if not await self._write_wanted():
            self._unwritten.set()

    def _keep_later(self, role: InstanceRole) -> None:
        """`keep`, by `write_loop` only (etcd did not answer just now)."""
        self._wanted = role
        self._unwritten.set()

    def _log_unread(self, exc: Exception) -> None:
        log.warning("role_mark_unread", instance_id=self._instance_id, role=self._command_line_role.value,
                    error=error_text(exc))

    async def write_loop(self) -> None:
        """Write a mark that did not go through, with backoff, until etcd takes it (the newest role)."""
        backoff = Backoff(initial_s=0.5, max_s=5.0)
        while True:
            await self._unwritten.wait()
            self._unwritten.clear()
            while self._wanted is not None:
                if await self._write_wanted():
                    backoff.reset()
                else:
                    await backoff.sleep()

    async def _write_wanted(self) -> bool:
        """Write the newest role asked for, one write at a time (so an older one never lands last)."""
        async with self._lock:
            role = self._wanted
            if role is None:
                return True
            is_written = await self._write(role)
            if is_written and self._wanted is role:
                self._wanted = None
            return is_written

    async def _write(self, role: InstanceRole) -> bool:
        key = role_mark_key(self._instance_id)
        try:
            if role is self._command_line_role:
                await self._registry.delete_json_if(key, lambda _mark: True)
            else:
                await self._registry.put_json(key, {
                    "instance_id": self._instance_id, "role": role.value,
                    "command_line_role": self._command_line_role.value, "set_at": time.time()})
        except (Unavailable, *ETCD_ERRORS) as exc:
            log.warning("role_mark_not_written", instance_id=self._instance_id, role=role.value,
                        error=error_text(exc))
            return False
        return True


def _parse(mark: object) -> tuple[InstanceRole, InstanceRole] | None:
    """(role, command line role it was set over), or None if the mark is not one."""
    if not isinstance(mark, dict):
        return None
    try:
        return InstanceRole(mark.get("role")), InstanceRole(mark.get("command_line_role"))
    except ValueError:
        return None
