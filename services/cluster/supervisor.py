"""Restarting the launcher's children that exit on their own (`up --restart on-failure`, the default).

What systemd's `Restart=on-failure` and compose's `restart: unless-stopped` do in deployment, the
launcher does on one machine: a child that fails (crashed, OOM-killed, SIGKILLed by hand: any exit
status but 0; a service stopped with SIGTERM exits 0 and stays down) starts again with the same
command line, so on the same port and under the same id. An instance comes back
empty (its requests were resumed elsewhere when it died) and registers again; a transfer service
comes back without mappings and every instance maps its KV memory into it again; etcd comes back on
its data dir.

Bounded like systemd's start limit: a child gets `burst` restarts within `window_s`, waiting
`first_delay_s` before the first and twice as long before each next one (at most `max_delay_s`).
Past that it stays down, and `process_given_up` says so once with its log. A child the launcher
stops on purpose (scaling down, Ctrl-C) is never restarted.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from services.common.error_text import error_text

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    on_failure: bool = True  # False (--restart no): report exits, restart nothing
    burst: int = 5  # restarts a child may have within window_s
    window_s: float = 300.0
    first_delay_s: float = 1.0  # before the first restart; doubles before each next one
    max_delay_s: float = 30.0


class Child(Protocol):
    """A supervised process: one of the launcher's services, or etcd."""

    name: str
    any_exit_fails: bool  # True: even a clean exit (0, SIGTERM) is a failure to restart after (etcd)

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def is_stopping(self) -> bool: ...  # stopped on purpose: not an exit to act on

    async def restart(self) -> int | None: ...  # the new pid; raises if it could not start


class Action(enum.Enum):
    NONE = "none"  # alive, or waiting out its delay, or given up earlier
    REPORT = "report"  # first seen down: log it
    RESTART = "restart"
    GIVE_UP = "give_up"  # its budget is spent: log it once, then NONE


@dataclass(slots=True)
class _History:
    restarts: list[float] = field(default_factory=list)  # times of its restarts within the window
    down_since: float | None = None  # when it was first seen down since it last ran
    given_up: bool = False


class Supervisor:
    """Decides, for each child on each look, whether to report, restart or give it up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._histories: dict[str, _History] = {}

    def forget_others(self, names: Collection[str]) -> None:
        """Drop the histories of children no longer listed (instances that scaling retired: their names
        never come back), so a launcher that scales for weeks keeps one history per child it runs."""
        for name in self._histories.keys() - set(names):
            del self._histories[name]

    def action(self, name: str, is_down: bool, now: float, failed: bool = True) -> Action:
        """`failed`: it did not exit cleanly (exit status 0, as after a SIGTERM, is left down)."""
        history = self._histories.setdefault(name, _History())
        if not is_down:
            history.down_since = None
            return Action.NONE
        if history.given_up:
            return Action.NONE
        history.restarts = [t for t in history.restarts if now - t < self._policy.window_s]
        is_restartable = self.restarts_after(failed)
        if is_restartable and len(history.restarts) >= self._policy.burst:
            history.given_up = True
            return Action.GIVE_UP
        if history.down_since is None:
            history.down_since = now
            return Action.REPORT
        if not is_restartable:
            return Action.NONE
        if now - history.down_since < self.delay_s(len(history.restarts)):
            return Action.NONE
        history.restarts.append(now)
        history.down_since = None
        return Action.RESTART

    def delay_s(self, num_recent_restarts: int) -> float:
        return min(self._policy.first_delay_s * 2 ** num_recent_restarts, self._policy.max_delay_s)

    def has_given_up(self, name: str) -> bool:
        return name in self._histories and self._histories[name].given_up

    def restarts_after(self, failed: bool) -> bool:
        """Whether an exit is one to start a child again after (its budget aside)."""
        return self._policy.on_failure and failed

    def will_restart(self, name: str, failed: bool) -> bool:
        """Whether child `name`, down after such an exit, is (or will be) started again."""
        return self.restarts_after(failed) and not self.has_given_up(name)

    @property
    def num_known(self) -> int:
        """Children with a history here (at most those of the launcher's list at its last look)."""
        return len(self._histories)

    def num_restarts(self, name: str) -> int:
        return len(self._histories.get(name, _History()).restarts)

    def restarts_what(self, failed: bool) -> str:
        if not self._policy.on_failure:
            return "it stays down (--restart no)"
        return "it starts again" if failed else "it stays down (it exited cleanly, as after a SIGTERM)"

    def give_up_reason(self) -> str:
        return f"it exited {self._policy.burst + 1} times within {self._policy.window_s:g} s; it stays down"


def exited_cleanly(returncode: int | None) -> bool:
    """Exit status 0, or ended by SIGTERM/SIGINT (an operator's `kill PID`, also before the child had set up
    its own handler, which exits 0): as systemd counts them, left down. None (unknown) is a failure."""
    return returncode in (0, -signal.SIGTERM, -signal.SIGINT)


async def supervise_step(supervisor: Supervisor, children: list[Child], now: float) -> bool:
    """Look at every child once; True when one exited or was started again (cluster.json then changes)."""
    changed = False
    supervisor.forget_others([child.name for child in children])
    for child in children:
        is_down = not child.is_alive() and not child.is_stopping()  # is_alive() first: it reaps, setting returncode
        failed = child.any_exit_fails or not exited_cleanly(child.returncode)
        action = supervisor.action(child.name, is_down, now, failed)
        if action is Action.REPORT:
            log.warning("process_exited", name=child.name, pid=child.pid, returncode=child.returncode,
                        log=_log_of(child), then=supervisor.restarts_what(failed))
        elif action is Action.GIVE_UP:
            log.error("process_given_up", name=child.name, pid=child.pid, returncode=child.returncode,
                      log=_log_of(child), reason=supervisor.give_up_reason())
        elif action is Action.RESTART:
            await _restart(child, supervisor.num_restarts(child.name))
        changed = changed or action is not Action.NONE
    return changed


async def _restart(child: Child, attempt: int) -> None:
    try:
        pid = await child.restart()
    except Exception as exc:  # noqa: BLE001 — it counts as a restart; the next look may try again
        log.warning("process_restart_failed", name=child.name, attempt=attempt, error=error_text(exc))
        return
    log.warning("process_restarted", name=child.name, pid=pid, attempt=attempt)


def _log_of(child: Child) -> str:
    return str(getattr(child, "log_path", ""))
