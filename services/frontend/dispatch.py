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
failure, admitted while only larger instances served). Nor is one of another model: its record names a
vocabulary of another size than the frontend's --model (it would refuse the prompt's token ids as outside
its vocabulary, a 400 for a good request, or read them as other tokens); the load policy sent every request
to such an instance, the freest, while the right ones idled (`instance_model_mismatch`, logged once). Nor one
whose record names other weights (a model fingerprint other than the --model folder's: another fine-tune of
the same base, which would answer as that fine-tune); a record or a folder without a fingerprint is not checked.
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
    model: str = ""  # the model folder's name it registered
    vocab_size: int = 0  # its model's vocabulary; 0: unknown (a record from before the field)
    model_fingerprint: str = ""  # a hash of its weights (model_fingerprint.py); "": unknown


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
                 clock: Callable[[], float] = time.monotonic, vocab_size: int = 0,
                 model_fingerprint: str = "") -> None:
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
        self._vocab_size = vocab_size  # our model's (0: instances are not checked)
        self._model_fingerprint = model_fingerprint  # our weights' ("": not checked; our folder holds none)
        self._other_model: frozenset[InstanceId] = frozenset()  # as last seen, each logged once when it appeared

    async def pick(self, spec: GenerateSpec, exclude: Sequence[InstanceId] = ()) -> Target:
        """An instance for `spec`, one in `exclude` only if nothing else serves; Unavailable if none is known."""
        unfit = [*self._too_short_for(spec), *self._other_model_ids()]
        if self._manager is not None:
            answer = await self._manager.dispatch(spec, [*exclude, *unfit])
            if isinstance(answer, Declined) and exclude and not self.lists_instances:
                # no instance list to fall back on: as pick_locally does, one in `exclude` if nothing else
                # serves (a one-instance cluster whose instance restarted)
                answer = await self._manager.dispatch(spec, ())
                if isinstance(answer, Target):
                    return answer
            if isinstance(answer, Target) and answer.instance_id not in exclude and answer.instance_id not in unfit:
                return answer
        target = self.pick_locally(exclude, unfit)
        self._on_fallback()
        log.info("dispatch_fell_back", request_id=spec.request_id, instance_id=target.instance_id)
        return target

    def pick_locally(self, exclude: Sequence[InstanceId] = (), too_short: Sequence[InstanceId] = ()) -> Target:
        """Round robin over serving instances, never one in `too_short` (see `_too_short_for`)."""
        known = self._membership.instances()
        serving = sorted((e for e in known if e.is_serving), key=lambda e: e.instance_id)
        other_model = self._other_model_ids()
        if serving and all(e.instance_id in other_model for e in serving):
            raise Unavailable(f"no serving instance serves this frontend's model: {self._other_model_text(serving)}; "
                              "start instances with the frontend's --model folder")
        serving = [e for e in serving if e.instance_id not in other_model]
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

    def _other_model_ids(self) -> frozenset[InstanceId]:
        """Instances whose record names a vocabulary or weights other than our model's; logs each once when it
        appears."""
        entries = [e for e in self._membership.instances() if self._is_other_model(e)]
        ids = frozenset(e.instance_id for e in entries)
        for e in entries:
            if e.instance_id not in self._other_model:
                log.warning("instance_model_mismatch", instance_id=e.instance_id, model=e.model,
                            vocab_size=e.vocab_size, own_vocab_size=self._vocab_size,
                            model_fingerprint=e.model_fingerprint or None,
                            own_model_fingerprint=self._model_fingerprint or None,
                            action="no request goes to it: start it with the frontend's --model folder")
        self._other_model = ids
        return ids

    def _is_other_model(self, e: InstanceEntry) -> bool:
        return ((self._vocab_size > 0 and 0 < e.vocab_size != self._vocab_size)
                or bool(self._model_fingerprint and e.model_fingerprint and e.model_fingerprint != self._model_fingerprint))

    def _other_model_text(self, entries: Sequence[InstanceEntry]) -> str:
        shown = ", ".join(f"{e.instance_id} ({e.model or 'a model'} with {e.vocab_size} tokens"
                          f"{f', weights {e.model_fingerprint}' if e.model_fingerprint else ''})" for e in entries[:4])
        weights = f" and weights {self._model_fingerprint}" if self._model_fingerprint else ""
        return f"{shown}, not this frontend's vocabulary of {self._vocab_size} tokens{weights}"

    def report_failure(self, instance_id: InstanceId) -> None:
        now = self._clock()
        self._failed_at = {i: at for i, at in self._failed_at.items() if now - at <= self._cooldown_s}
        self._failed_at[instance_id] = now

    def num_serving(self) -> int:
        return sum(e.is_serving and not self._is_other_model(e) for e in self._membership.instances())

    def num_registered(self) -> int:
        return len(self._membership.instances())

    def serves_besides(self, exclude: Sequence[InstanceId], spec: GenerateSpec | None = None) -> bool:
        """Whether an instance not in `exclude` serves (else a resume can only go back to one that failed),
        one that holds `spec` if given. Without an instance list (no etcd) only the manager knows: assumed so."""
        unfit = [*(self._too_short_for(spec) if spec is not None else []), *self._other_model_ids()]
        return not self.lists_instances or any(e.is_serving and e.instance_id not in exclude and
                                               e.instance_id not in unfit for e in self._membership.instances())

    def max_model_len(self, model_limit: int) -> int:
        """The longest sequence every serving instance takes: `model_limit`, or less where an
        instance's record says its KV cache holds fewer tokens (any instance may get a request)."""
        limits = [e.max_model_len for e in self._membership.instances()
                  if e.is_serving and e.max_model_len > 0 and not self._is_other_model(e)]
        return min([model_limit, *limits])

    def _recently_failed(self, instance_id: InstanceId) -> bool:
        failed_at = self._failed_at.get(instance_id)
        if failed_at is None:
            return False
        if self._clock() - failed_at > self._cooldown_s:
            del self._failed_at[instance_id]
            return False
        return True
