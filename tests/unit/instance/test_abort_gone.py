"""The instance's Abort of a request it no longer holds: NOT_FOUND, marked expected (rpc_failed at debug).

A client that hangs up makes the frontend cancel its Generate stream and send Abort; when the cancel
got there first the request is gone, which is what the Abort wanted. Before, the instance logged each
such answer as rpc_failed code=NOT_FOUND at info."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from services.common.errors import ErrorInterceptor, NotFound
from services.common.gen.ferry.v1 import common_pb2, instance_pb2
from services.instance.config import InstanceRole
from services.instance.server import InstanceIdentity, InstanceServicer

pytestmark = pytest.mark.timeout(10)


class GoneRunner:
    async def abort(self, request_id: str, copy=None) -> bool:
        return False

    def stream(self, request_id: str) -> None:
        return None


class Refused(Exception):
    pass


class FakeContext:
    def peer(self):
        return "ipv4:127.0.0.1:50000"

    async def abort(self, code, details, trailing_metadata=()):
        self.code = code
        raise Refused


class Details:
    method = "/ferry.v1.InstanceService/Abort"
    invocation_metadata = ()


async def test_an_abort_of_a_request_already_gone_answers_not_found_logged_at_debug():
    servicer = InstanceServicer(GoneRunner())
    servicer.identity = InstanceIdentity("i", "127.0.0.1:2", InstanceRole.BOTH, "m", 1024, common_pb2.KvGeometry())

    async def continuation(_details):
        return grpc.unary_unary_rpc_method_handler(servicer.Abort)
    handler = await ErrorInterceptor().intercept_service(continuation, Details())
    context = FakeContext()
    with capture_logs() as logs, pytest.raises(Refused):
        await handler.unary_unary(instance_pb2.AbortRequest(request_id="r"), context)
    assert context.code is grpc.StatusCode.NOT_FOUND
    assert [(e["event"], e["log_level"]) for e in logs] == [("rpc_failed", "debug")]
    with pytest.raises(NotFound):  # the servicer alone, as the other instance tests call it
        await servicer.Abort(instance_pb2.AbortRequest(request_id="r"), None)
