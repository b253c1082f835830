"""The instance's config refuses migration timeouts that cannot keep a reservation alive to its commit."""

from __future__ import annotations

import pytest

from services.common.config import parse_config
from services.instance.config import InstanceConfig

pytestmark = pytest.mark.timeout(10)


def _parse(*argv: str) -> InstanceConfig:
    return parse_config(InstanceConfig, "instance", ["--model", "m", *argv], {})


@pytest.mark.parametrize("reservation_s", ["21", "25"])
def test_a_reservation_timeout_within_a_copy_and_a_commit_is_refused_naming_the_flags(reservation_s, capsys):
    """Before, only reservation > transfer was required: 21 s (transfer 20 s, rpc 5 s) was accepted, and the
    reservation, refreshed before the last copy, could expire while that copy and the commit after it took their
    deadlines (the driver's refresh interval, reservation - transfer - rpc, was at or below 0)."""
    with pytest.raises(SystemExit):
        _parse("--migration-reservation-timeout-s", reservation_s)
    error = capsys.readouterr().err
    for flag in ("--migration-reservation-timeout-s", "--migration-transfer-timeout-s", "--migration-rpc-timeout-s"):
        assert flag in error


def test_a_reservation_timeout_past_a_copy_and_a_commit_is_accepted():
    config = _parse("--migration-reservation-timeout-s", "4", "--migration-transfer-timeout-s", "2.5",
                    "--migration-rpc-timeout-s", "1")
    assert config.migration_reservation_timeout_s == 4
    assert _parse().migration_reservation_timeout_s == 30  # the defaults: 30 > 20 + 5
