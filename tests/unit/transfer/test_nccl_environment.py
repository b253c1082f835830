"""The transfer service makes NCCL waits blocking and keeps its watchdog from killing the process."""

from __future__ import annotations

import pytest

from services.transfer.pair_channel import NCCL_ENVIRONMENT, configure_nccl

pytestmark = pytest.mark.timeout(10)


def test_blocking_waits_and_no_process_teardown_are_set():
    environ: dict[str, str] = {"PATH": "/bin"}
    configure_nccl(environ)
    assert environ == {"PATH": "/bin", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_an_operators_other_value_is_overridden():
    environ = {"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    configure_nccl(environ)
    assert environ == NCCL_ENVIRONMENT
