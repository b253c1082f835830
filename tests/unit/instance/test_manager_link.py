"""The instance's link to the leader manager (PD calls) against a real gRPC server on loopback."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.gen.ferry.v1 import manager_pb2, manager_pb2_grpc
from services.instance.manager_client import PLACE_DECODE_TIMEOUT_S, ManagerLink

pytestmark = pytest.mark.timeout(30)


class FrozenLeader(manager_pb2_grpc.ManagerServiceServicer):
    """A leader that takes calls and never answers (SIGSTOPped before its lease ran out)."""

    async def PlaceDecode(self, request, context):
        await asyncio.sleep(60)
        return manager_pb2.PlaceDecodeResponse()


async def test_place_decode_gives_up_on_a_frozen_leader_within_its_short_deadline():
    """Parked requests wait for it one after another: before, each waited the whole migration RPC timeout."""
    server = grpc.aio.server()
    manager_pb2_grpc.add_ManagerServiceServicer_to_server(FrozenLeader(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = ManagerLink(SimpleNamespace(leader=SimpleNamespace(address=f"127.0.0.1:{port}")), timeout_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await link.place_decode("r-1", "p-1", 0)
        assert time.monotonic() - started < PLACE_DECODE_TIMEOUT_S + 1.0
    finally:
        await link.close()
        await server.stop(0)
