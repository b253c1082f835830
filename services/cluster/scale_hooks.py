"""Follow the leader's scaling decisions with commands: for clusters run by systemd (or anything else).

    python -m services.cluster.scale_hooks --etcd-endpoints 127.0.0.1:2379 \\
        --add-command 'systemctl start ferry-instance@{next_index}' \\
        --stop-command 'systemctl stop ferry-instance@{index}'

Every --interval-s it reads etcd `/ferry/<cluster>/scaling/target` (scaling.py) and the
registered instances (`instances/`), and plans like the local launcher does
(scaling_follower.plan): it runs --stop-command once for each registered instance the
target lists as stoppable, and --add-command when fewer instances serve than the target
asks for; after an add it waits until one more instance has registered (or
--add-timeout-s) before adding again. Commands run without a shell, each bounded by
--command-timeout-s; their failures are logged and tried again on a later tick.

Placeholders: {instance_id}, {index} (the number at the end of the instance id: 2 for
host-2) in --stop-command; {next_index} (the lowest index no registered instance has) and
{num_instances} (the target) in --add-command.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field

import structlog

from services.cluster.scaling_follower import plan
from services.common.config import DefaultsHelpFormatter, OneLineErrorParser, knob_help
from services.common.error_text import error_text, typed_error_text
from services.common.etcd_client import EtcdAccess, EtcdKnobs
from services.common.etcd_endpoints import check_address_flag
from services.common.events import wait_set
from services.common.ids import check_cluster_flag
from services.common.logging import LogFormat, setup_logging
from services.common.registry import Registry
from services.common.scaling_target import SCALING_TARGET_KEY, ScalingTarget
from services.common.signals import stop_event

log = structlog.get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m services.cluster.scale_hooks", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--etcd-endpoints", required=True, help="etcd endpoints host:port, comma-separated")
    parser.add_argument("--cluster", default="ferry", help="cluster name (etcd keys live under /ferry/<cluster>/)")
    parser.add_argument("--add-command", required=True,
                        help="command that starts one more instance; {next_index} and {num_instances} are filled in")
    parser.add_argument("--stop-command", required=True,
                        help="command that stops a retired instance; {instance_id} and {index} are filled in")
    parser.add_argument("--interval-s", type=float, default=2.0, help="seconds between reads of the target")
    parser.add_argument("--command-timeout-s", type=float, default=120.0, help="longest a command may run")
    parser.add_argument("--add-timeout-s", type=float, default=300.0,
                        help="after an add, seconds to wait for the new instance to register before adding again")
    for knob_field in dataclasses.fields(EtcdKnobs):  # etcd TLS and auth, as every service takes them
        parser.add_argument(f"--{knob_field.name.replace('_', '-')}", default=knob_field.default,
                            help=knob_help(knob_field))
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the flag for a value the follower could not run with."""
    check_cluster_flag(args.cluster)
    check_address_flag("--etcd-endpoints", args.etcd_endpoints.split(","))
    for flag in ("interval_s", "command_timeout_s", "add_timeout_s"):
        value = getattr(args, flag)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of seconds, got {value}")


def etcd_access(args: argparse.Namespace) -> EtcdAccess:
    knobs = EtcdKnobs(**{knob_field.name: getattr(args, knob_field.name) for knob_field in dataclasses.fields(EtcdKnobs)})
    access = knobs.etcd_access
    access.check()
    return access


def lowest_free_index(registered: list[str]) -> int:
    """The lowest instance index no registered instance has: one retired from the middle (the leader
    retires the emptiest) is started again, so env files for indexes 0 .. max-1 always suffice."""
    taken = {index_of(i) for i in registered}
    return next(i for i in range(len(taken) + 1) if i not in taken)


def index_of(instance_id: str) -> int:
    """The number an instance id ends with (host-2 → 2), or -1."""
    match = re.search(r"(\d+)$", instance_id)
    return int(match.group(1)) if match else -1


@dataclass(slots=True)
class HookFollower:
    add_command: str
    stop_command: str
    command_timeout_s: float
    add_timeout_s: float
    stop_requested: set[str] = field(default_factory=set)
    adding: tuple[int, float] | None = None  # (instances registered when we added, give up waiting at)

    def step(self, target: ScalingTarget | None, registered: list[str]) -> None:
        self.stop_requested &= set(registered)  # gone: forget
        wanted = plan(target, registered)
        if wanted is None:
            return
        for instance_id in wanted.to_stop:
            if instance_id not in self.stop_requested and self._run(
                    self.stop_command.format(instance_id=instance_id, index=index_of(instance_id))):
                self.stop_requested.add(instance_id)  # a failed stop is tried again on the next tick
        if self.adding is not None and (len(registered) > self.adding[0] or time.monotonic() > self.adding[1]):
            self.adding = None
        if wanted.should_add and self.adding is None:
            next_index = lowest_free_index(registered)
            self._run(self.add_command.format(next_index=next_index, num_instances=target.num_instances))
            self.adding = (len(registered), time.monotonic() + self.add_timeout_s)

    def _run(self, command: str) -> bool:
        """Run one hook command; True if it succeeded."""
        log.info("scale_hook_running", command=command)
        try:
            done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=self.command_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("scale_hook_failed", command=command, error=typed_error_text(exc))
            return False
        if done.returncode != 0:
            log.warning("scale_hook_failed", command=command, returncode=done.returncode, stderr=done.stderr[-2000:])
        return done.returncode == 0


async def follow(args: argparse.Namespace, access: EtcdAccess) -> None:
    follower = HookFollower(args.add_command, args.stop_command, args.command_timeout_s, args.add_timeout_s)
    stop = stop_event()
    async with Registry(args.etcd_endpoints.split(","), args.cluster, access=access) as registry:
        members = await registry.watch("instances")
        while not stop.is_set():
            try:
                target = ScalingTarget.from_json(await registry.get_json(SCALING_TARGET_KEY))
                await asyncio.to_thread(follower.step, target, sorted(members.members))
            except Exception as exc:  # noqa: BLE001 — etcd away: try again next tick
                log.warning("scale_hooks_step_failed", error=error_text(exc))
            await wait_set(stop, args.interval_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        access = etcd_access(args)
    except ValueError as exc:
        raise SystemExit(f"python -m services.cluster.scale_hooks: {exc}") from None
    setup_logging("scale_hooks", LogFormat.CONSOLE)
    asyncio.run(follow(args, access))


if __name__ == "__main__":
    main()
