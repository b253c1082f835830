"""Migration between two hosts: instance A in this network namespace, instance B in a
namespace of its own, joined by a veth pair (the project's own test hosts, made and
removed by this test). KV blocks cross the link over the grpc transfer backend.

Two setups: every service on the host's link address, and the systemd env files' across
machines (INSTALL.md): the transfer service bound to 0.0.0.0 advertising the link address, each
instance reaching its own at `--transfer-address 127.0.0.1:P` as shipped. In the second, a
destination named its transfer service to the source as 127.0.0.1:P, so the source's transfer
service sent the blocks to its own host (a black-box run on three "hosts", 2026-12-07)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid

import grpc
import pytest

from services.cluster.processes import ServiceProcess, stop_all
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc, transfer_pb2
from services.instance.engine.factory import EngineSpec, build_engine
from services.instance.engine.request import SamplingParams

pytestmark = pytest.mark.timeout(180)

HOST_A, HOST_B = "10.231.77.1", "10.231.77.2"  # the test's own veth link, nothing else
NUM_BLOCKS, BLOCK_SIZE, MAX_TOKENS = 320, 4, 1000  # long: still running when the migration comes
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 8, 64, 2, 11]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`) to make network namespaces"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    probe = f"ferry-probe-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=10)
    if result.returncode != 0:
        return f"cannot make network namespaces here: {result.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@pytest.fixture(scope="module")
def host_b():
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    namespace, veth = f"ferry-b-{uuid.uuid4().hex[:6]}", f"fa{uuid.uuid4().hex[:6]}"
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth-b", "netns", namespace)
        _ip("addr", "add", f"{HOST_A}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", namespace, "addr", "add", f"{HOST_B}/30", "dev", "eth-b")
        _ip("-n", namespace, "link", "set", "eth-b", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield namespace
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)  # removes the veth pair


def _start(name: str, module: str, host: str, args: list[str], log_dir, prefix: list[str],
           bind: str = "") -> ServiceProcess:
    port = free_port()
    binding = ["--host", bind, "--advertise-host", host] if bind else ["--host", host]
    return ServiceProcess(name, module, [*binding, "--port", str(port), *args], f"{host}:{port}",
                          log_dir, prefix=prefix).start()


@pytest.fixture(scope="module", params=["link-address", "as-shipped"])
def two_hosts(request, host_b, tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("netns-logs")
    on_b = ["ip", "netns", "exec", host_b]
    as_shipped = request.param == "as-shipped"
    processes = {}
    try:
        for side, host, prefix in (("a", HOST_A, []), ("b", HOST_B, on_b)):
            processes[f"t{side}"] = _start(f"transfer-{side}", "transfer", host,
                                           ["--transfer-id", f"t{side}", "--num-threads", "1"], log_dir, prefix,
                                           bind="0.0.0.0" if as_shipped else "")
            asyncio.run(processes[f"t{side}"].wait_healthy(60))
            transfer_port = processes[f"t{side}"].address.rpartition(":")[2]
            processes[side] = _start(
                side, "instance", host,
                ["--model", str(tiny_model_dir), "--instance-id", side, "--num-threads", "1",
                 "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                 "--transfer-address", f"127.0.0.1:{transfer_port}" if as_shipped else processes[f"t{side}"].address,
                 "--transfer-backend", "grpc", "--verify-transfer-checksum"], log_dir, prefix)
        for side in ("a", "b"):
            asyncio.run(processes[side].wait_healthy(90))
        yield processes
    finally:
        stop_all(processes.values())


async def test_request_migrates_across_the_link_with_reference_tokens(two_hosts, tiny_model_dir):
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a_address, b_address = two_hosts["a"].address, two_hosts["b"].address
    async with grpc.aio.insecure_channel(a_address) as a, grpc.aio.insecure_channel(b_address) as b:
        stub_a, stub_b = instance_pb2_grpc.InstanceServiceStub(a), instance_pb2_grpc.InstanceServiceStub(b)
        call = stub_a.Generate(instance_pb2.GenerateRequest(request_id="x-1", prompt_token_ids=PROMPT,
                                                            sampling=sampling), timeout=60)
        first = await call.read()
        tokens = {first.token_index + i: t for i, t in enumerate(first.token_ids)}
        result = await stub_a.MigrateOut(instance_pb2.MigrateOutRequest(
            request_id="x-1", dst_instance_id="b", dst_address=b_address,
            backend=transfer_pb2.TRANSFER_BACKEND_GRPC), timeout=60)
        handoff = None
        while (chunk := await call.read()) is not grpc.aio.EOF:
            tokens.update({chunk.token_index + i: t for i, t in enumerate(chunk.token_ids)})
            if chunk.HasField("handoff"):
                handoff = chunk.handoff
        assert handoff is not None and handoff.dst_address == b_address
        attached = stub_b.Attach(instance_pb2.AttachRequest(request_id="x-1", from_token_index=handoff.next_token_index,
                                                            epoch=handoff.epoch), timeout=60)
        async for chunk in attached:
            for i, token in enumerate(chunk.token_ids):
                assert chunk.token_index + i not in tokens, "duplicate token index"
                tokens[chunk.token_index + i] = token
    assert result.num_blocks > 0 and result.num_bytes > 0
    assert sorted(tokens) == list(range(MAX_TOKENS))
    loaded = build_engine(EngineSpec(tiny_model_dir, kv_name=f"ferry-netns-ref-{os.getpid()}", block_size=BLOCK_SIZE,
                                     num_blocks=NUM_BLOCKS))
    try:
        reference = loaded.engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True))[0]
    finally:
        loaded.close()
    assert [tokens[i] for i in range(MAX_TOKENS)] == reference
