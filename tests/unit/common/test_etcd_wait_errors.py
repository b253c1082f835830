"""The startup wait for etcd waits out what etcd may answer while it starts, is busy or restarts."""
import grpc
import pytest

from services.common.registry import Registry

pytestmark = pytest.mark.timeout(20)


class _Err(grpc.aio.AioRpcError):
    def __init__(self, code, details):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FlakyKv:
    def __init__(self, errors):
        self.errors = list(errors)

    async def get(self, *args, **kwargs):
        if self.errors:
            raise self.errors.pop(0)
        return None


class FakeClient:
    def __init__(self, errors):
        self.kv = FlakyKv(errors)


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: not capable"),  # etcd still negotiating its version
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests"),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),  # etcd restarted mid-call
])
async def test_a_transient_etcd_error_at_startup_is_waited_out(code, details):
    registry = Registry(["127.0.0.1:1"], "c")
    client = FakeClient([_Err(code, details)])

    async def connect():
        return client
    registry._connect = connect
    await registry.wait_until_reachable(5.0)
