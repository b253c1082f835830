"""Typed async client of `ManagerService/Dispatch` as the frontend uses it: the leader's
address comes from a `LeaderSource`, the call has a short deadline, and any failure means
"no manager answered" (None), which sends the caller to its local fallback.

`manager_dispatch_failed` is rate-limited (log_sampling.py): a manager down or without instances
fails every dispatch alike, so per (address, code) the first is logged, then one per 10 s with
`suppressed`."""

from __future__ import annotations

import asyncio

from collections.abc import Sequence
from typing import Protocol

import grpc
import structlog

from services.common.errors import was_answered
from services.common.grpc_server import secure_or_insecure_channel
from services.common.log_sampling import LogSampler
from services.common.tls import TlsConfig
from services.common.logging import request_metadata
from services.common.gen.ferry.v1 import manager_pb2_grpc
from services.frontend.convert import dispatch_request_to_proto, target_from_proto
from services.frontend.generation import Declined, GenerateSpec, InstanceId, Target

log = structlog.get_logger(__name__)


class LeaderSource(Protocol):
    def leader_address(self) -> str | None:
        """The leader manager's host:port, None if unknown."""


class StaticLeader:
    def __init__(self, address: str) -> None:
        self._address = address

    def leader_address(self) -> str | None:
        return self._address


class ManagerClient:
    def __init__(self, leader: LeaderSource, timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._leader = leader
        self._timeout_s = timeout_s
        self._tls = tls
        self._address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: manager_pb2_grpc.ManagerServiceStub | None = None
        self._failure_log = LogSampler()

    async def dispatch(self, spec: GenerateSpec, exclude: Sequence[InstanceId]) -> Target | Declined | None:
        stub = await self._stub_for(self._leader.leader_address())
        if stub is None:
            return None
        try:
            response = await stub.Dispatch(dispatch_request_to_proto(spec, exclude), timeout=self._timeout_s,
                                           metadata=request_metadata(spec.request_id))
        except grpc.aio.AioRpcError as exc:  # no answer in time, a standby, no instance: fall back
            self._log_failed(spec, exc.code().name, exc.details())
            if exc.code() is grpc.StatusCode.UNAVAILABLE and was_answered(exc):
                return Declined(exc.details() or "no instance")
            return None
        except asyncio.CancelledError:
            if _is_cancelled(asyncio.current_task()):
                raise  # our caller is cancelled (the client went away)
            self._log_failed(spec, "CANCELLED", "the leader moved and its channel was closed")
            return None  # the call died with the channel the leader moved away from: fall back
        return target_from_proto(response)

    def _log_failed(self, spec: GenerateSpec, code: str, details: str | None) -> None:
        if (suppressed := self._failure_log.admit((self._address, code))) is not None:
            log.info("manager_dispatch_failed", request_id=spec.request_id, address=self._address, code=code,
                     details=details, suppressed=suppressed)

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def _stub_for(self, address: str | None) -> manager_pb2_grpc.ManagerServiceStub | None:
        """The stub for the leader at `address`. The switch happens before any await, so concurrent
        dispatches that see the leader move open one channel between them and close the old one once."""
        if address == self._address:
            return self._stub
        old, self._address = self._channel, address
        self._channel = secure_or_insecure_channel(address, self._tls) if address else None
        self._stub = manager_pb2_grpc.ManagerServiceStub(self._channel) if self._channel is not None else None
        stub = self._stub
        if old is not None:
            await old.close()
        return stub


def _is_cancelled(task: asyncio.Task | None) -> bool:
    return task is not None and task.cancelling() > 0
