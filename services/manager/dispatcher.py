"""Dispatch: the leader picks a serving instance for a new request with the current policy.

Every dispatch is reserved on the chosen instance at once (see cluster_view.py), so the
next dispatch, even microseconds later, sees that instance as a little more loaded.

Prefill/decode disaggregation (README "Prefill/decode disaggregation"): new requests go to prefill-capable instances
(PREFILL, BOTH); DECODE instances only when none of those serves (the request prefills
there; `RoleGaps` logs and counts it) or, with --pd-short-prompt-tokens, for a prompt that
short. `place_decode` picks the DECODE instance (by load) a prefilled request moves to.
"""

from __future__ import annotations

import structlog

from services.common.errors import ResourceExhausted, Unavailable
from services.common.periodic import periodic_loop
from services.manager.cluster_view import ClusterView
from services.manager.domain import (ALL_ROLES, DECODE_ROLES, PREFILL_ROLES, Candidate, DispatchAsk, InstanceId,
                                     Placement, Role, serves_shorter)
from services.manager.leadership import Leadership
from services.manager.policies import DEFAULT_POLICY, DEFAULT_PREFIX_LOAD_SLACK, DispatchPolicy, LoadPolicy, make_policy
from services.manager.role_gaps import RoleGaps

log = structlog.get_logger(__name__)

ROLE_GAP_INTERVAL_S = 1.0  # how soon ferry_manager_pd_role_missing drops once the role serves again
_DECODE_POLICY = LoadPolicy()  # decode instances are chosen by load, whatever the dispatch policy


class Dispatcher:
    def __init__(self, view: ClusterView, leadership: Leadership, policy_name: str = DEFAULT_POLICY,
                 short_prompt_tokens: int = 0, prefix_load_slack: int = DEFAULT_PREFIX_LOAD_SLACK) -> None:
        self._view = view
        self._leadership = leadership
        self._prefix_load_slack = prefix_load_slack
        self._policy: DispatchPolicy = make_policy(policy_name, prefix_load_slack=prefix_load_slack)
        self._short_prompt_tokens = short_prompt_tokens  # 0 = off
        self.role_gaps = RoleGaps()

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def set_policy(self, name: str) -> None:
        """Switch policy (ValueError for unknown names); a no-op keeps the policy's state."""
        if name != self._policy.name:
            self._policy = make_policy(name, prefix_load_slack=self._prefix_load_slack)
            log.info("dispatch_policy_changed", policy=name)

    def dispatch(self, ask: DispatchAsk) -> Placement:
        """Where `ask` should run; Unavailable if this manager does not lead or nothing serves."""
        self._leadership.check_leader()
        candidates = self._dispatch_candidates(ask)
        if not candidates:
            raise Unavailable(self._view.explain_no_candidate(ask.exclude_instance_ids))
        chosen = self._policy.choose(candidates, ask)
        record = self._view.record(chosen.instance_id)
        self._view.reserve(chosen.instance_id, ask.num_prompt_blocks(record.block_size, record.kv_window_tokens))
        return Placement(chosen.instance_id, chosen.address, self._policy.name,
                         can_prefill_on_decode=record.role is Role.DECODE)

    def place_decode(self, request_id: str, src_instance_id: str, num_blocks: int,
                     refused: frozenset[InstanceId] = frozenset(), max_num_tokens: int = 0) -> Placement:
        """The DECODE instance (most free) a prefilled request holding `num_blocks` moves to, one with room for
        them and a free migration slot first; BOTH instances if no DECODE one serves. `refused`: those that just
        refused it (no room). Those serving shorter sequences than the request may reach (`max_num_tokens`, 0: not
        known) would refuse it.

        Unavailable when none serves (or none serves sequences that long), ResourceExhausted when all that serve
        refused it: the request keeps decoding where it is."""
        self._leadership.check_leader()
        exclude = frozenset({InstanceId(src_instance_id)})
        candidates = self._reported_first(self._of_model(src_instance_id, exclude, DECODE_ROLES)
                                          or self._of_model(src_instance_id, exclude, frozenset({Role.BOTH})))
        if not candidates:
            self.role_gaps.note_missing(Role.DECODE, request_id)
            raise Unavailable(f"no decode instance serves; request {request_id} keeps decoding on "
                              f"{src_instance_id} (start one, or SetRole an instance to ROLE_DECODE)")
        self.role_gaps.note_present(Role.DECODE)
        candidates = [c for c in candidates
                      if not serves_shorter(max_num_tokens, self._view.record(c.instance_id).max_model_len)]
        if not candidates:
            raise Unavailable(f"no decode instance serves sequences of {max_num_tokens} tokens (prompt + max_tokens); "
                              f"request {request_id} keeps decoding on {src_instance_id}")
        candidates = [c for c in candidates if c.instance_id not in refused]
        if not candidates:
            raise ResourceExhausted(f"every decode instance refused request {request_id} ({', '.join(sorted(refused))}:"
                                    f" no free KV blocks or batch slot); it keeps decoding on {src_instance_id}")
        candidates = ([c for c in candidates if c.load.has_room_for(num_blocks) and c.load.has_free_migration_slot]
                      or candidates)  # (a view may be stale)
        chosen = _DECODE_POLICY.choose(candidates, DispatchAsk(request_id))
        self._view.reserve(chosen.instance_id, num_blocks, is_dispatch=False)  # dispatched already, to its prefill
        return Placement(chosen.instance_id, chosen.address, "pd")

    def _of_model(self, src_instance_id: str, exclude: frozenset[InstanceId], roles: frozenset[Role]) -> list[Candidate]:
        """The candidates of `roles` a request of `src_instance_id` can move to: an instance of another model (its
        record names another KV layout, vocabulary or model fingerprint) would fail the copy, "kv geometry
        mismatch", or decode on as another model (another fine-tune: other answers, silently)."""
        candidates = self._view.candidates(exclude, roles)
        if not self._view.has_member(src_instance_id):
            return candidates
        src = self._view.record(InstanceId(src_instance_id))
        return [c for c in candidates if src.holds_same_model(self._view.record(c.instance_id))]

    async def role_gap_loop(self, interval_s: float = ROLE_GAP_INTERVAL_S) -> None:
        await periodic_loop("role_gap_loop", interval_s, self._refresh_role_gaps)

    async def _refresh_role_gaps(self) -> None:
        """Close a gap that an instance of the role fills again, though no request has needed the
        role since (dispatch notes a gap only when a request asks)."""
        if self.role_gaps.is_missing(Role.PREFILL) and self._view.candidates(roles=PREFILL_ROLES):
            self.role_gaps.note_present(Role.PREFILL)
        if self.role_gaps.is_missing(Role.DECODE) and self._view.candidates(roles=DECODE_ROLES | {Role.BOTH}):
            self.role_gaps.note_present(Role.DECODE)

    def _reported_first(self, candidates: list[Candidate]) -> list[Candidate]:
        """Those known to live (reported in this term, or registered during it: `is_vouched_for`), if any are.
        One still in its grace looks empty (no load known): after a takeover a dead instance whose key outlives
        it would draw most dispatches for --report-timeout-s while the live ones already report. One that
        registered in this term is a live process: passed over, it drew nothing until its first report, so a
        burst right after a start all went to the instance that reported first."""
        return [c for c in candidates if self._view.is_vouched_for(c.instance_id)] or candidates

    def _dispatch_candidates(self, ask: DispatchAsk) -> list[Candidate]:
        return self._reported_first(self._role_candidates(ask))

    def _role_candidates(self, ask: DispatchAsk) -> list[Candidate]:
        exclude = ask.exclude_instance_ids
        if self._is_short(ask):
            return self._view.candidates(exclude, ALL_ROLES)
        candidates = self._view.candidates(exclude, PREFILL_ROLES)
        if candidates:
            self.role_gaps.note_present(Role.PREFILL)
            return candidates
        decode = self._view.candidates(exclude, DECODE_ROLES)
        if decode:
            self.role_gaps.note_missing(Role.PREFILL, ask.request_id)
        return decode

    def _is_short(self, ask: DispatchAsk) -> bool:
        return 0 < ask.num_prompt_tokens < self._short_prompt_tokens
