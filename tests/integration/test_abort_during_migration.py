"""A client that goes away while its request migrates, when the frontend's Abort (--abort-timeout-s,
2 s) gives up before the instance has done what it asked: real sim instances A and B with a transfer
service; the frontend's own `InstanceClients` sends the Abort, the test reads the streams as the
frontend's gRPC layer does.

The frontend left A's stream with the hand-off delivered but not acted on (its task was cancelled
as the chunk arrived), so its Abort goes to A, which must drop the copy on B with AbortMigrateIn
(--migration-rpc-timeout-s, 5 s): nobody will attach to it. Whether that copy is dropped must not
depend on how long the frontend waits for the Abort's answer.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import grpc
import pytest
from structlog.testing import capture_logs

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.frontend.config import FrontendConfig
from services.frontend.generation import InstanceId, RequestId, Target
from services.frontend.instance_client import InstanceClients

pytestmark = pytest.mark.timeout(150)

ABORT_TIMEOUT_S = FrontendConfig.__dataclass_fields__["abort_timeout_s"].default  # the frontend's default
PREFILL_MS_PER_TOKEN = 15.0  # a BIG_PROMPT step takes 3 s, longer than ABORT_TIMEOUT_S
BIG_PROMPT = [(7 * i) % 200 + 1 for i in range(200)]  # one prefill chunk (the CPU's is 224 tokens)
PROMPT = [5, 17, 42, 99, 7, 3]
RESERVATION_TIMEOUT_S = 30.0  # B's watchdog drops an unattached copy only after this: far past the test's wait
DROP_WAIT_S = 6.0  # from the Abort's start: the big step (3 s) plus the AbortMigrateIn, with room on a busy host


def _instance(name: str, model_dir, transfer_address: str, common: list[str], log_dir) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, "instance", [
        "--model", str(model_dir), "--port", str(port), "--instance-id", name, "--num-threads", "1",
        "--num-blocks", "512", "--block-size", "4", "--max-model-len", "1024", "--engine", "sim",
        "--sim-prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN), "--transfer-address", transfer_address,
        "--migration-reservation-timeout-s", str(RESERVATION_TIMEOUT_S), *common], f"127.0.0.1:{port}", log_dir)


@pytest.fixture(scope="module")
def instances(etcd, tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("abort-migration-logs")
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster", f"abm-{uuid.uuid4().hex[:6]}"]
    port = free_port()
    transfer = ServiceProcess("t", "transfer", ["--port", str(port), "--transfer-id", "t", "--num-threads", "1",
                                                *common], f"127.0.0.1:{port}", log_dir)
    processes = [transfer]
    try:
        transfer.start()
        asyncio.run(transfer.wait_healthy(60))
        processes += [_instance(name, tiny_model_dir, transfer.address, common, log_dir).start() for name in "ab"]
        for process in processes[1:]:
            asyncio.run(process.wait_healthy(90))
        yield {p.name: p for p in processes}
    finally:
        for process in processes:
            process.signal(signal.SIGCONT)
        stop_all(processes)


@pytest.fixture
async def stubs(instances):
    async with (grpc.aio.insecure_channel(instances["a"].address) as a,
                grpc.aio.insecure_channel(instances["b"].address) as b):
        yield {"a": instance_pb2_grpc.InstanceServiceStub(a), "b": instance_pb2_grpc.InstanceServiceStub(b)}


async def _handed_off_unread(stubs, instances, request_id: str) -> None:
    """A request migrated from A to B whose hand-off chunk reached the frontend and was never acted on."""
    call = stubs["a"].Generate(instance_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)), timeout=60)
    for _ in range(5):
        assert (await call.read()).token_ids
    await stubs["a"].MigrateOut(instance_pb2.MigrateOutRequest(
        request_id=request_id, dst_instance_id="b", dst_address=instances["b"].address), timeout=30)
    while not (await call.read()).HasField("handoff"):
        pass
    call.cancel()  # the frontend's task was cancelled with the chunk in hand: it still names A as the owner
    assert await _on_b(stubs, request_id), "the copy on b should decode until something drops it"


async def _on_b(stubs, request_id: str) -> bool:
    listed = await stubs["b"].ListRequests(instance_pb2.ListRequestsRequest(), timeout=5)
    return request_id in [r.request_id for r in listed.requests]


async def _assert_dropped_on_b(stubs, request_id: str, started_at: float) -> None:
    while await _on_b(stubs, request_id):
        assert time.monotonic() - started_at < DROP_WAIT_S, (
            f"the copy of {request_id} on b still decodes for no client {DROP_WAIT_S:g} s after the frontend's Abort "
            f"(its watchdog drops it after {RESERVATION_TIMEOUT_S:g} s)")
        await asyncio.sleep(0.05)


async def _assert_every_block_free(stubs) -> None:
    """Once nothing runs on either instance, every KV block of both is free again (none leaked)."""
    deadline = time.monotonic() + DROP_WAIT_S
    for name in ("a", "b"):
        while (load := (await stubs[name].GetStatus(instance_pb2.GetStatusRequest(), timeout=5)).load) \
                .num_free_blocks != load.num_total_blocks:
            assert time.monotonic() < deadline, f"{name}: {load.num_free_blocks}/{load.num_total_blocks} blocks free"
            await asyncio.sleep(0.05)


async def _frontend_abort(instances, request_id: str) -> list[dict]:
    """Abort as the frontend sends it when its client went away; its log lines."""
    clients = InstanceClients(generate_timeout_s=30.0, abort_timeout_s=ABORT_TIMEOUT_S)
    try:
        with capture_logs() as logs:
            await clients.abort_soon(Target(InstanceId("a"), instances["a"].address), RequestId(request_id))
    finally:
        await clients.close()
    return logs


def _first_abort_code(logs: list[dict]) -> str | None:
    """How the frontend's first Abort try ended, if not in an answer (it is tried again then)."""
    return next((e["code"] for e in logs if e["event"] in ("abort_retrying", "abort_failed")), None)


async def test_an_abort_that_outlives_the_frontends_deadline_still_drops_the_unread_copy(stubs, instances):
    """A's engine is in a 3 s step when the Abort comes, so the frontend gives up after 2 s. Before, gRPC then
    cancelled A's Abort handler while it waited for the engine, and the drop of the copy on B that comes after
    never ran: the copy decoded for no client until B's watchdog (--migration-reservation-timeout-s)."""
    request_id = f"busy-{uuid.uuid4().hex[:6]}"
    await _handed_off_unread(stubs, instances, request_id)
    big = stubs["a"].Generate(instance_pb2.GenerateRequest(
        request_id=f"big-{request_id}", prompt_token_ids=BIG_PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)), timeout=60)
    while f"big-{request_id}" not in [r.request_id for r in (await stubs["a"].ListRequests(
            instance_pb2.ListRequestsRequest(), timeout=5)).requests]:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # its prefill step (3 s) has begun
    started_at = time.monotonic()
    logs = await _frontend_abort(instances, request_id)
    assert _first_abort_code(logs) == "DEADLINE_EXCEEDED", "the scenario needs an Abort that outlives the frontend's deadline"
    await _assert_dropped_on_b(stubs, request_id, started_at)
    async for _ in big:
        pass
    await _assert_every_block_free(stubs)


async def test_a_destination_slow_to_drop_the_copy_still_drops_it(stubs, instances):
    """The 5 s AbortMigrateIn A sends B outlives the frontend's 2 s Abort (B frozen for 3 s): the drop goes on in a
    task of A's own, so the copy is dropped once B answers (this held before too: evidence, not a fix)."""
    request_id = f"slow-{uuid.uuid4().hex[:6]}"
    await _handed_off_unread(stubs, instances, request_id)
    instances["b"].signal(signal.SIGSTOP)
    try:
        started_at = time.monotonic()
        abort = asyncio.create_task(_frontend_abort(instances, request_id))
        await asyncio.sleep(3.0)
    finally:
        instances["b"].signal(signal.SIGCONT)
    logs = await abort
    assert _first_abort_code(logs) == "DEADLINE_EXCEEDED"
    await _assert_dropped_on_b(stubs, request_id, started_at)
    await _assert_every_block_free(stubs)
