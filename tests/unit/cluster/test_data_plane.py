"""How the launcher wires transfer services to instances: one for the machine, or with nccl one
per instance on that instance's GPU (NCCL refuses both ends of a pair on one GPU)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from services.cluster.__main__ import parse_args
from services.cluster.launcher import LocalCluster
from tests.unit.cluster.test_ports import spec

pytestmark = pytest.mark.timeout(10)


def data_plane(transfer_backend: str) -> list:
    cluster = LocalCluster(dataclasses.replace(spec(18000, 18001), transfer_backend=transfer_backend))
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    return cluster._data_plane()


def flag(process, name: str) -> str:
    return process.args[process.args.index(name) + 1]


def test_one_transfer_service_maps_every_instance():
    transfer, *instances = data_plane("auto")
    assert transfer.name == "transfer-0" and [p.name for p in instances] == ["instance-0", "instance-1"]
    assert all(flag(p, "--transfer-address") == transfer.address for p in instances)
    assert "--nccl-device" not in transfer.args


def test_with_nccl_each_instance_has_its_own_transfer_service_and_gpu():
    processes = data_plane("nccl")
    assert [p.name for p in processes] == ["transfer-0", "instance-0", "transfer-1", "instance-1"]
    for transfer, instance in zip(processes[::2], processes[1::2]):
        assert flag(instance, "--transfer-address") == transfer.address
        assert flag(instance, "--transfer-backend") == "nccl"
        assert flag(transfer, "--backends") == "grpc,nccl" and flag(transfer, "--default-backend") == "nccl"
        assert flag(transfer, "--nccl-device").isdigit()
    assert len({p.address for p in processes}) == 4


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal on a host with fewer than 2 GPUs")
def test_nccl_without_two_gpus_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["up", "--transfer-backend", "nccl"])
    assert "--transfer-backend nccl needs 2 or more CUDA devices" in capsys.readouterr().err


def test_transfer_services_run_a_few_torch_threads_not_one_per_core():
    """A transfer service left at torch's default took a thread per core for its gathers and scatters, next
    to instances pinned to their share of the cores."""
    for transfer_backend in ("auto", "nccl"):
        transfers = [p for p in data_plane(transfer_backend) if p.name.startswith("transfer-")]
        assert [flag(p, "--num-threads") for p in transfers] == ["2"] * len(transfers)
    spec_ = dataclasses.replace(spec(18000, 18001), transfer_threads=3)
    cluster = LocalCluster(spec_)
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    assert flag(cluster._data_plane()[0], "--num-threads") == "3"
    assert parse_args(["up", "--transfer-threads", "3"]).transfer_threads == 3
