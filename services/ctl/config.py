"""Global options of ferryctl; each subcommand adds its own arguments."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import knob


@dataclass(frozen=True, slots=True)
class CtlConfig:
    """Administer a ferry cluster through the manager's AdminService."""

    admin: str = knob("127.0.0.1:50051", "admin address host:port of any manager (a standby forwards reads to the leader)")
    token: str = knob("", "bearer token sent as `authorization: Bearer TOKEN` metadata (for managers or proxies that check it)")
    json: bool = knob(False, "print JSON instead of tables")
    timeout_s: float = knob(5.0, "deadline of each admin call in seconds")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s must be positive, got {self.timeout_s}")
        if not self.admin:
            raise ValueError("--admin is empty; give the manager's admin address, e.g. --admin 127.0.0.1:50051")
