"""A client-streaming write that fails because the destination ended the stream reads as INTERNAL
"Internal error from Core" in grpc's asyncio client (grpc/grpc#36066), whether the destination died
or refused the blocks. The sender tells them apart by asking the destination afterwards
(tests/integration/test_transfer.py: a refused large transfer is NOT_FOUND, a killed destination
UNAVAILABLE); here only which errors count as such a failed write."""

from __future__ import annotations

import grpc
import pytest

from services.transfer.client import _is_failed_write

pytestmark = pytest.mark.timeout(10)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, details, expected", [
    (grpc.StatusCode.INTERNAL, "Internal error from Core", True),
    (grpc.StatusCode.INTERNAL, "internal error; the server logged it", False),  # the peer itself answered so
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free staging slot", False),
])
def test_which_errors_are_a_failed_write(code, details, expected):
    assert _is_failed_write(rpc_error(code, details)) is expected
