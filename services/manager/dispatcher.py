"""Dispatch: the leader picks a serving instance for a new request with the current policy.

Every dispatch is reserved on the chosen instance at once (see cluster_view.py), so the
next dispatch, even microseconds later, sees that instance as a little more loaded.
"""

from __future__ import annotations

import structlog

from services.common.errors import Unavailable
from services.manager.cluster_view import ClusterView
from services.manager.domain import DispatchAsk, Placement
from services.manager.leadership import Leadership
from services.manager.policies import DEFAULT_POLICY, DispatchPolicy, make_policy

log = structlog.get_logger(__name__)


class Dispatcher:
    def __init__(self, view: ClusterView, leadership: Leadership, policy_name: str = DEFAULT_POLICY) -> None:
        self._view = view
        self._leadership = leadership
        self._policy: DispatchPolicy = make_policy(policy_name)

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def set_policy(self, name: str) -> None:
        """Switch policy (ValueError for unknown names); a no-op keeps the policy's state."""
        if name != self._policy.name:
            self._policy = make_policy(name)
            log.info("dispatch_policy_changed", policy=name)

    def dispatch(self, ask: DispatchAsk) -> Placement:
        """Where `ask` should run; Unavailable if this manager does not lead or nothing serves."""
        self._leadership.check_leader()
        candidates = self._view.candidates(ask.exclude_instance_ids)
        if not candidates:
            raise Unavailable(self._view.explain_no_candidate(ask.exclude_instance_ids))
        chosen = self._policy.choose(candidates, ask)
        block_size = self._view.record(chosen.instance_id).block_size
        self._view.reserve(chosen.instance_id, ask.num_prompt_blocks(block_size))
        return Placement(chosen.instance_id, chosen.address, self._policy.name)
