"""The frontend's own view of the cluster in etcd: the instances (for the local dispatch
fallback and /health, less those an operator drained) and the leader manager's address.
Both read watches that keep the last known values while etcd is unreachable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from services.common.election import LeaderView
from services.common.membership import MembershipView
from services.frontend.dispatch import InstanceEntry
from services.frontend.generation import InstanceId

_SERVING_STATES = frozenset({"serving", "instance_state_serving"})


def instance_entry(instance_id: str, value: Mapping[str, Any]) -> InstanceEntry | None:
    """An entry from an `instances/<id>` value (JSON with address and state); None if unusable."""
    address = value.get("address")
    if not isinstance(address, str) or not address:
        return None
    state = str(value.get("state", "serving")).lower()
    is_decode_only = str(value.get("role", "both")).lower() == "decode"
    return InstanceEntry(InstanceId(instance_id), address, is_serving=state in _SERVING_STATES,
                         is_decode_only=is_decode_only, max_model_len=_positive_int(value.get("max_model_len")),
                         model=str(value.get("model", "")), vocab_size=_positive_int(value.get("vocab_size")),
                         model_fingerprint=_text(value.get("model_fingerprint")))


def _positive_int(value: Any) -> int:
    """A record's count, or 0 (unknown) when it is missing or not a positive int."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _text(value: Any) -> str:
    """A record's string, or "" (unknown) when it is missing or not a string."""
    return value if isinstance(value, str) else ""


class EtcdInstances:
    """`Membership` over `/ferry/<cluster>/instances/`; an instance an operator drained (its mark
    under `config/drain/`, which the manager writes) is not serving, so the fallback avoids it too."""

    def __init__(self, view: MembershipView, drain_marks: MembershipView | None = None) -> None:
        self._view = view
        self._drain_marks = drain_marks

    def instances(self) -> Sequence[InstanceEntry]:
        drained = self._drain_marks.members.keys() if self._drain_marks is not None else frozenset()
        entries = (instance_entry(member_id, value) for member_id, value in self._view.members.items())
        return [replace(entry, is_serving=False) if entry.instance_id in drained else entry
                for entry in entries if entry is not None]

    @property
    def staleness_s(self) -> float:
        """Seconds since etcd last confirmed the instances (see MembershipView.staleness_s)."""
        return self._view.staleness_s


class EtcdLeader:
    """`LeaderSource` over `/ferry/<cluster>/manager/leader` (JSON with an "address" field; one that
    LeaderView cannot read counts as no leader, so requests are placed by the fallback)."""

    def __init__(self, view: LeaderView) -> None:
        self._view = view

    def leader_address(self) -> str | None:
        leader = self._view.leader
        return leader.address if leader is not None and leader.address else None
