"""The local launcher's side of scaling: follow the leader's etcd scaling/target with processes.

The leader manager decides (services/manager/scaling.py) and writes its target
(services/common/scaling_target.py) to /ferry/<cluster>/scaling/target.
Every second the launcher compares it with its own instance processes: it stops the
ones listed `stoppable` (drained: nothing runs there), and starts a new `both` instance
(the next unused `instance-<n>` id) while fewer than `num_instances` serve. Instances
listed `draining` keep running until they become stoppable. Only clusters without
prefill/decode roles follow it, as only they scale.

At startup the launcher overwrites the target with what it starts (no manager id), so an
old target kept in a --state-dir is not acted on; until a leader writes one, nothing is
followed. An instance that crashed counts as running while the launcher is about to start it
again (supervisor.py), so scaling does not also replace it; one the launcher gave up on (or,
with --restart no, any that died) is replaced by a new instance once scaling is active. The
launcher never runs more than --autoscale-max-instances, even when a policy stored in a kept
--state-dir lets the leader ask for more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.cluster.processes import ServiceProcess
from services.common.error_text import error_text
from services.common.events import wait_set
from services.common.registry import Registry
from services.common.scaling_target import SCALING_TARGET_KEY, ScalingTarget

log = structlog.get_logger(__name__)

FOLLOW_INTERVAL_S = 1.0
FAILURE_DELAY_S = 10.0


class ScalableCluster(Protocol):
    processes: list[ServiceProcess]
    max_instances: int  # --autoscale-max-instances: never more, whatever the target says

    def will_run(self, process: ServiceProcess) -> bool: ...  # alive, or exited and about to start again

    async def add_instance(self) -> ServiceProcess: ...
    def rewrite_state(self) -> None: ...  # cluster.json again (a failure is logged and retried)


def instance_processes(cluster: ScalableCluster) -> list[ServiceProcess]:
    return [p for p in cluster.processes if p.module == "instance"]


async def reset_target(registry: Registry, num_instances: int) -> None:
    """At startup: what the launcher starts is the target (an old one from a kept --state-dir is not)."""
    await registry.put_json(SCALING_TARGET_KEY, ScalingTarget(num_instances, reason="launcher started").to_json())


POLICY_KEY = "config/policy"  # services/manager/config_store.py: its "scaling" entry wins over the manager's flags


async def align_stored_scaling(registry: Registry, min_instances: int, max_instances: int) -> None:
    """At startup with --autoscale-max-instances: a scaling band stored in a kept --state-dir (which
    the manager's --scaling-* flags do not override) gets this launcher's bounds, and is on, so the
    leader never asks for an instance the launcher would not start, and waits for it."""
    policy = await registry.get_json(POLICY_KEY)
    scaling = policy.get("scaling") if isinstance(policy, dict) else None
    if not isinstance(scaling, dict):
        return  # nothing stored: the manager uses the flags the launcher gives it
    bounds = {"enabled": True, "min_instances": min_instances, "max_instances": max_instances}
    if {key: scaling.get(key) for key in bounds} != bounds:
        await registry.put_json(POLICY_KEY, {**policy, "scaling": {**scaling, **bounds}})
        log.info("stored_scaling_bounds_aligned", was={key: scaling.get(key) for key in bounds}, now=bounds)


@dataclass(frozen=True, slots=True)
class FollowPlan:
    to_stop: tuple[str, ...]  # running instances the target lists as stoppable
    should_add: bool  # fewer than num_instances serve (running and not retiring)


def plan(target: ScalingTarget | None, running: Sequence[str], max_instances: int | None = None) -> FollowPlan | None:
    """What the target asks of a launcher whose instances `running` run now; None: nothing to follow
    (no target, or the launcher's own from startup: until a leader decides). It never asks for more
    than `max_instances` running (None: no cap of its own), even when a policy stored earlier lets the
    leader want more."""
    if target is None or not target.is_decided:
        return None
    retiring = set(target.stoppable) | set(target.draining)
    serving = [name for name in running if name not in retiring]
    return FollowPlan(tuple(name for name in running if name in target.stoppable),
                      len(serving) < target.num_instances and (max_instances is None or len(running) < max_instances))


async def follow_step(cluster: ScalableCluster, registry: Registry) -> None:
    running = {p.name: p for p in instance_processes(cluster) if cluster.will_run(p)}
    step = plan(ScalingTarget.from_json(await registry.get_json(SCALING_TARGET_KEY)), list(running),
                cluster.max_instances)
    if step is None:
        return
    for name in step.to_stop:
        process = running[name]
        process.stopping = True  # before the watcher can see it exit and start it again
        await asyncio.to_thread(process.stop)
        cluster.processes.remove(process)
        cluster.rewrite_state()
        log.info("scaling_instance_stopped", name=process.name, pid=process.pid)
    if step.should_add:
        process = await cluster.add_instance()
        cluster.rewrite_state()
        log.info("scaling_instance_started", name=process.name, pid=process.pid)


async def follow_scaling(cluster: ScalableCluster, registry: Registry, stop: asyncio.Event) -> None:
    """`follow_step` every second until `stop`; a failed step (etcd away, a child that would not start) is
    logged and the next one waits FAILURE_DELAY_S."""
    while not stop.is_set():
        delay_s = FOLLOW_INTERVAL_S
        try:
            await follow_step(cluster, registry)
        except Exception as exc:  # noqa: BLE001 — the launcher keeps serving; the next step tries again
            log.warning("scaling_follow_failed", error=error_text(exc), retry_in_s=FAILURE_DELAY_S)
            delay_s = FAILURE_DELAY_S  # e.g. an instance that would not start: do not start one every second
        await wait_set(stop, delay_s)
