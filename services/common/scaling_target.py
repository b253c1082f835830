"""The scaling decision the leader manager writes and launchers follow: etcd /ferry/<cluster>/scaling/target.

    {"num_instances": 3,            # instances that should be serving
     "draining": ["instance-2"],    # retiring: being drained, keep them running
     "stoppable": ["instance-4"],   # retired and empty: stop them now
     "reason": "...", "manager_id": "m-0", "updated_at": 1760000000.0}

The manager (services/manager/scaling.py) writes it; `python -m services.cluster up` and
`python -m services.cluster.scale_hooks` follow it. A target without a manager id is a
launcher's own, written at startup: nothing to follow until a leader decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCALING_TARGET_KEY = "scaling/target"  # under /ferry/<cluster>/


@dataclass(slots=True)
class ScalingTarget:
    num_instances: int
    draining: list[str] = field(default_factory=list)
    stoppable: list[str] = field(default_factory=list)
    reason: str = ""
    manager_id: str = ""  # who decided; empty: a launcher's startup target
    updated_at: float = 0.0  # unix seconds

    @property
    def is_decided(self) -> bool:
        """Written by a leader manager (not a launcher's startup target)."""
        return bool(self.manager_id)

    def to_json(self) -> dict:
        return {"num_instances": self.num_instances, "draining": sorted(self.draining),
                "stoppable": sorted(self.stoppable), "reason": self.reason, "manager_id": self.manager_id,
                "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, value: object) -> ScalingTarget | None:
        """The stored target; None when absent or malformed."""
        try:
            return cls(int(value["num_instances"]), [str(i) for i in value.get("draining", [])],
                       [str(i) for i in value.get("stoppable", [])], str(value.get("reason", "")),
                       str(value.get("manager_id", "")), float(value.get("updated_at", 0.0)))
        except (TypeError, KeyError, ValueError, AttributeError):
            return None
