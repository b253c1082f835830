"""Where a request runs: the leader manager decides; if it does not answer in time, we pick
ourselves from our own view of `instances/` (round robin over serving instances).

The fallback avoids, in this order of preference, instances the caller excludes (the one
whose stream just broke) and instances whose stream failed within the last cooldown
seconds; it returns to them only when no other serving instance is known (one instance
that dropped a stream is still better than none; the caller bounds the retries). Like the
manager's dispatch it prefers prefill-capable instances (role prefill or both) and sends a
request to a decode instance only when none of those serves. An instance whose record says it
serves shorter sequences than the request may reach (prompt + max_tokens) is never picked,
by the manager or here: it would end the request early with `length` (a resume after a
failure, admitted while only larger instances served).
No transport here: the manager call and the membership view are passed in.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.common.errors import Unavailable
from services.frontend.generation import Declined, GenerateSpec, InstanceId, Target

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceEntry:
    """One instance in the frontend's etcd view."""

    instance_id: InstanceId
    address: str
    is_serving: bool
    is_decode_only: bool = False  # role decode: takes new requests only when no prefill-capable instance serves
    max_model_len: int = 0  # the longest sequence it serves (its KV cache may hold less than the model); 0: unknown


class ManagerDispatch(Protocol):
    async def dispatch(self, spec: GenerateSpec, exclude: Sequence[InstanceId]) -> Target | Declined | None:
        """The leader's choice; Declined when it answered that no instance serves (besides `exclude`);
        None when no manager answered in time (any other error included)."""


class Membership(Protocol):
    def instances(self) -> Sequence[InstanceEntry]:
        """The last known instances (kept while etcd is unreachable)."""


class NoInstances:
    """`Membership` when the frontend runs without etcd (only --manager-address)."""

    def instances(self) -> Sequence[InstanceEntry]:
        return []

    staleness_s = 0.0


class Dispatcher:
    def __init__(self, manager: ManagerDispatch | None, membership: Membership, *, cooldown_s: float,
                 on_fallback: Callable[[], None] = lambda: None,
                 on_role_fallback: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._manager = manager
        self._membership = membership
        self.lists_instances = not isinstance(membership, NoInstances)  # else the manager alone knows them
        self._cooldown_s = cooldown_s
        self._on_fallback = on_fallback
        self._on_role_fallback = on_role_fallback  # no prefill-capable instance: a decode instance prefills
        self._clock = clock
        # instance → when its stream last failed; only those within the cooldown are kept (an instance
        # that failed and left is never looked up again, and ids are fresh per start in some deployments)
        self._failed_at: dict[InstanceId, float] = {}
        self._turn = itertools.count()

    async def pick(self, spec: GenerateSpec, exclude: Sequence[InstanceId] = ()) -> Target:
        """An instance for `spec`, one in `exclude` only if nothing else serves; Unavailable if none is known."""
        too_short = self._too_short_for(spec)
        if self._manager is not None:
            answer = await self._manager.dispatch(spec, [*exclude, *too_short])
            if isinstance(answer, Declined) and exclude and not self.lists_instances:
                # no instance list to fall back on: as pick_locally does, one in `exclude` if nothing else
                # serves (a one-instance cluster whose instance restarted)
                answer = await self._manager.dispatch(spec, ())
                if isinstance(answer, Target):
                    return answer
            if isinstance(answer, Target) and answer.instance_id not in exclude and answer.instance_id not in too_short:
                return answer
        target = self.pick_locally(exclude, too_short)
        self._on_fallback()
        log.info("dispatch_fell_back", request_id=spec.request_id, instance_id=target.instance_id)
        return target

    def pick_locally(self, exclude: Sequence[InstanceId] = (), too_short: Sequence[InstanceId] = ()) -> Target:
        """Round robin over serving instances, never one in `too_short` (see `_too_short_for`)."""
        known = self._membership.instances()
        serving = sorted((e for e in known if e.is_serving), key=lambda e: e.instance_id)
        if serving and all(e.instance_id in too_short for e in serving):
            longest = max(e.max_model_len for e in serving)
            raise Unavailable(f"no serving instance holds this request's prompt + max_tokens: the longest "
                              f"sequence one serves now is {longest} tokens (an instance with a larger KV cache "
                              "may be restarting)")
        serving = [e for e in serving if e.instance_id not in too_short]
        if not serving and known:
            raise Unavailable(f"no serving instance: {len(known)} registered, none serving (drained, draining "
                              "or starting); undo a drain with `python -m services.ctl drain ID --undo` (ferryctl)")
        if not serving and not self.lists_instances:
            raise Unavailable("the manager (--manager-address) placed no request: no instance serves, or the "
                              "manager did not answer")
        if not serving:
            raise Unavailable("no serving instance is known; check that instances run and register in etcd "
                              "(--etcd-endpoints, --cluster)")
        allowed = [e for e in serving if e.instance_id not in exclude]
        healthy = [e for e in allowed if not self._recently_failed(e.instance_id)]
        pool = healthy or allowed or serving
        prefill = [e for e in pool if not e.is_decode_only]  # PD: decode instances only when no prefill one serves
        if not prefill:
            self._on_role_fallback()
            log.warning("dispatch_role_fell_back", role_missing="prefill", num_decode=len(pool))
        entry = (prefill or pool)[next(self._turn) % len(prefill or pool)]
        return Target(entry.instance_id, entry.address, can_prefill_on_decode=entry.is_decode_only)

    def _too_short_for(self, spec: GenerateSpec) -> list[InstanceId]:
        """Instances whose record says they serve fewer tokens than `spec` may reach (prompt + max_tokens):
        there it would finish early with `length`. The frontend admits a request against the least
        serving instance's limit, so only one admitted before a smaller instance came is affected."""
        if spec.sampling.max_tokens is None:
            return []
        num_tokens = len(spec.prompt_token_ids) + spec.sampling.max_tokens
        return [e.instance_id for e in self._membership.instances() if 0 < e.max_model_len < num_tokens]

    def report_failure(self, instance_id: InstanceId) -> None:
        now = self._clock()
        self._failed_at = {i: at for i, at in self._failed_at.items() if now - at <= self._cooldown_s}
        self._failed_at[instance_id] = now

    def num_serving(self) -> int:
        return sum(e.is_serving for e in self._membership.instances())

    def num_registered(self) -> int:
        return len(self._membership.instances())

    def serves_besides(self, exclude: Sequence[InstanceId], spec: GenerateSpec | None = None) -> bool:
        """Whether an instance not in `exclude` serves (else a resume can only go back to one that failed),
        one that holds `spec` if given. Without an instance list (no etcd) only the manager knows: assumed so."""
        too_short = self._too_short_for(spec) if spec is not None else []
        return not self.lists_instances or any(e.is_serving and e.instance_id not in exclude and
                                               e.instance_id not in too_short for e in self._membership.instances())

    def max_model_len(self, model_limit: int) -> int:
        """The longest sequence every serving instance takes: `model_limit`, or less where an
        instance's record says its KV cache holds fewer tokens (any instance may get a request)."""
        limits = [e.max_model_len for e in self._membership.instances() if e.is_serving and e.max_model_len > 0]
        return min([model_limit, *limits])

    def _recently_failed(self, instance_id: InstanceId) -> bool:
        failed_at = self._failed_at.get(instance_id)
        if failed_at is None:
            return False
        if self._clock() - failed_at > self._cooldown_s:
            del self._failed_at[instance_id]
            return False
        return True
