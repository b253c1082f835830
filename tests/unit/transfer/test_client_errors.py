"""A client-streaming write that fails because the destination died reads as INTERNAL "Internal
error from Core" in grpc's asyncio client (grpc/grpc#36066): the sender must call it UNAVAILABLE,
like any other dead peer, so that a migration aborts cleanly and is retried."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import Internal, ResourceExhausted, Unavailable
from services.transfer.client import _streaming_error

pytestmark = pytest.mark.timeout(10)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, details, expected", [
    (grpc.StatusCode.INTERNAL, "Internal error from Core", Unavailable),
    (grpc.StatusCode.INTERNAL, "internal error; the server logged it", Internal),  # the peer itself answered so
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free staging slot", ResourceExhausted),
])
def test_a_failed_write_is_a_dead_peer(code, details, expected):
    assert type(_streaming_error(rpc_error(code, details))) is expected
