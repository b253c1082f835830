"""Streams this instance's load to the leader manager (`ManagerService/ReportLoad`).

Load never goes through etcd: etcd only tells us who the leader is. The loop keeps
one client stream open to the current leader, sends a report every interval and at
once when the load changed a lot, and re-dials when the leader changes or the
stream breaks (with bounded backoff). An unregistered instance reports nothing: its id is no
member (the manager would drop the reports), or another process holds it (a replacement
started while this one was frozen), whose load the reports would overwrite.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from services.common.backoff import Backoff
from services.common.election import LeaderView, watch_leader
from services.common.events import wait_set
from services.common.gen.ferry.v1 import common_pb2, manager_pb2_grpc
from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig
from services.common.registry import Registry
from services.common.task_errors import read_error
from services.instance.server import InstanceServicer

log = structlog.get_logger(__name__)

WORKED_S = 1.0  # a stream that broke after this long had worked: redial at once, not after a grown backoff


async def load_report_loop(registry: Registry, servicer: InstanceServicer, interval_s: float,
                           tls: TlsConfig | None = None) -> None:
    leader_view = await watch_leader(registry)
    backoff = Backoff(initial_s=0.1, max_s=2.0)
    loop = asyncio.get_running_loop()
    while True:
        opened_at = loop.time()
        try:
            leader = leader_view.leader
            if leader is None:
                await _wait_for_leader(leader_view, timeout_s=2.0)
                continue
            await _report_to(leader.address, leader_view, servicer, interval_s, tls,
                             is_registered=lambda: registry.is_registered)
            backoff.reset()
        except grpc.aio.AioRpcError as exc:
            log.info("load_stream_broken", leader=leader.address, code=exc.code().name)
            if loop.time() - opened_at >= max(interval_s, WORKED_S):  # a blip, not a leader that keeps failing
                backoff.reset()  # (the manager counts this instance UNHEALTHY until it reports again)
            await _pause_before_redial(backoff, leader_view)
        except Exception:  # noqa: BLE001 — e.g. a malformed leader key: reports resume once it is fixed
            log.exception("load_report_failed")
            await backoff.sleep()


async def _report_to(address: str, leader_view: LeaderView, servicer: InstanceServicer, interval_s: float,
                     tls: TlsConfig | None, is_registered: Callable[[], bool] = lambda: True) -> None:
    """Stream reports to `address` until the leader changes (returns) or the stream breaks (raises)."""
    async with secure_or_insecure_channel(address, tls) as channel:
        stub = manager_pb2_grpc.ManagerServiceStub(channel)
        leader_changed = asyncio.ensure_future(leader_view.changed())
        failures: list[Exception] = []
        call = stub.ReportLoad(_reports(servicer, interval_s, leader_changed, failures, is_registered))
        log.info("load_stream_opened", leader=address)
        try:
            await _answer_unless_leader_changed(call, leader_changed)
        finally:
            leader_changed.cancel()
            call.cancel()
        if failures:
            raise failures[0]


async def _answer_unless_leader_changed(call: grpc.aio.StreamUnaryCall, leader_changed: asyncio.Future) -> None:
    """The stream's answer (raises its error), or nothing once the leader changed first: a leader frozen
    past its lease (SIGSTOP, a hung host) keeps the stream open and never answers, and waiting for it held
    reports from the new leader until keepalive dropped the connection, 5-10 s later."""
    answer = asyncio.ensure_future(call)
    try:
        await asyncio.wait((answer, leader_changed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not answer.done():
            answer.cancel()  # the caller cancels the call itself right after
        # An answer that fails as this is cancelled (the manager resigning on shutdown) is read
        # here, or asyncio logs it as "Task exception was never retrieved" with a traceback.
        answer.add_done_callback(read_error)
    if answer.done() and not answer.cancelled():
        answer.result()


async def _reports(servicer: InstanceServicer, interval_s: float, leader_changed: asyncio.Future,
                   failures: list[Exception], is_registered: Callable[[], bool]) -> AsyncIterator[common_pb2.LoadReport]:
    """Reports until the leader changes. An error ends the stream and goes to `failures`: raised in here,
    gRPC would cancel the call, and awaiting it would raise CancelledError, which ends the whole loop."""
    changed = asyncio.Event()
    servicer.on_load_change(changed.set)
    last = None
    try:
        while not leader_changed.done():
            report = servicer.load_report()
            is_due = last is None or _differs(report, last) or report.timestamp - last.timestamp >= interval_s
            # A stalled engine stays silent: the manager marks this instance UNHEALTHY and dispatches nothing to it.
            if is_due and not servicer.is_engine_stalled() and is_registered():
                yield report
                last = report
            changed.clear()
            await wait_set(changed, interval_s)
    except Exception as exc:  # noqa: BLE001 — handed to _report_to, which raises it after the call
        failures.append(exc)


def _differs(a: common_pb2.LoadReport, b: common_pb2.LoadReport) -> bool:
    """A big change: requests started, came in, were suspended or finished, or blocks moved by more than 1/16
    of the cache."""
    return (a.num_running != b.num_running or a.num_waiting != b.num_waiting or a.num_suspended != b.num_suspended
            or a.num_prefilled != b.num_prefilled or a.num_requests_admitted != b.num_requests_admitted
            or a.num_requests_migrated_in != b.num_requests_migrated_in
            or abs(a.num_free_blocks - b.num_free_blocks) * 16 > max(1, a.num_total_blocks))


async def _pause_before_redial(backoff: Backoff, leader_view: LeaderView) -> None:
    """The backoff's delay, cut short when the leader key changes: a dead leader's stream keeps
    failing until its lease ends, and by then the delay has grown to seconds; the new leader
    is dialed at once (a drain right after a failover otherwise saw this instance as silent)."""
    if await _wait_for_leader(leader_view, timeout_s=backoff.next_delay()):
        backoff.reset()


async def _wait_for_leader(leader_view: LeaderView, timeout_s: float) -> bool:
    """Whether the leader key changed within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            await leader_view.changed()
    except TimeoutError:
        return False
    return True
