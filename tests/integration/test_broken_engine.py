"""An instance whose engine step raises (here: injected into a real sim-engine instance process)
fails its streams with INTERNAL, then shuts down and exits 1, so its supervisor starts it again."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc

pytestmark = pytest.mark.timeout(120)

BREAKING_INSTANCE = """
import sys
from services.instance.engine.engine import LLMEngine
step, num_steps = LLMEngine.step, [0]
def breaking_step(self):
    num_steps[0] += 1
    if num_steps[0] > 3:
        raise RuntimeError("injected step failure")
    return step(self)
LLMEngine.step = breaking_step
from services.instance.__main__ import run
sys.argv = ["instance", *sys.argv[1:]]
run()
"""


def wait_until_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} never served"
            time.sleep(0.2)


def test_an_instance_whose_engine_breaks_fails_its_streams_and_exits_1(tiny_model_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "instance.log").open("w")
    process = subprocess.Popen([sys.executable, "-c", BREAKING_INSTANCE, "--model", str(tiny_model_dir),
                                "--port", str(port), "--engine", "sim", "--instance-id", "broken-0"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(f"127.0.0.1:{port}", 60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = instance_pb2_grpc.InstanceServiceStub(channel).Generate(instance_pb2.GenerateRequest(
                request_id="r-1", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=20)),
                timeout=30)
            with pytest.raises(grpc.RpcError) as failed:
                for _chunk in stream:
                    pass
        assert failed.value.code() is grpc.StatusCode.INTERNAL
        assert process.wait(timeout=30) == 1
    finally:
        process.kill()
        process.wait()
        log.close()
    assert "exiting with a failure so that a supervisor starts this instance again" in (tmp_path / "instance.log").read_text()
