"""Global options of ferryctl; each subcommand adds its own arguments."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.auth import read_token
from services.common.config import knob
from services.common.etcd_endpoints import check_address_flag
from services.common.tls import ClientTlsKnobs
from services.ctl.manager_pick import admin_addresses


@dataclass(frozen=True, slots=True)
class CtlConfig(ClientTlsKnobs):
    """Administer a ferry cluster through the manager's AdminService."""

    admin: str = knob("127.0.0.1:50051", "admin address host:port of any manager (a standby forwards to the leader); "
                      "several, comma-separated: the first that accepts a connection")
    token: str = knob("", "bearer token sent as `authorization: Bearer TOKEN` metadata: the manager's --admin-token")
    token_file: str = knob("", "file holding --token (instead of the flag or FERRY_CTL_TOKEN)")
    json: bool = knob(False, "print JSON instead of tables")
    timeout_s: float = knob(5.0, "deadline of each admin call in seconds")

    @property
    def resolved_token(self) -> str:
        return read_token(self.token, self.token_file, "token")

    def __post_init__(self) -> None:
        self.tls.check()
        read_token(self.token, self.token_file, "token")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):  # nan and inf too
            raise ValueError(f"--timeout-s must be a positive number of seconds, got {self.timeout_s}")
        if not self.admin:
            raise ValueError("--admin is empty; give the manager's admin address, e.g. --admin 127.0.0.1:50051")
        check_address_flag("--admin", admin_addresses(self.admin) or [self.admin])
