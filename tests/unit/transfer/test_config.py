"""The transfer service refuses at startup a backend it could never use, naming the flag."""

from __future__ import annotations

import pytest
import torch

from services.common.config import parse_config
from services.transfer.config import TransferConfig

pytestmark = pytest.mark.timeout(10)


def parse(*argv: str) -> TransferConfig:
    return parse_config(TransferConfig, "transfer", list(argv), env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_nccl_without_cuda_is_refused_at_startup(capsys):
    with pytest.raises(SystemExit):
        parse("--backends", "grpc,nccl")
    assert "--backends nccl: backend nccl needs CUDA" in capsys.readouterr().err


def test_nccl_device_past_the_visible_gpus_is_refused_at_startup(capsys):
    with pytest.raises(SystemExit):
        parse("--backends", "grpc,nccl", "--nccl-device", str(torch.cuda.device_count()))
    assert "--backends nccl:" in capsys.readouterr().err


def test_grpc_gloo_and_shm_start_anywhere():
    assert [b.value for b in parse("--backends", "grpc,gloo,shm").backends] == ["grpc", "gloo", "shm"]
