"""The transfer service's worker threads: with nccl, those that build groups and post and wait for
messages run with --nccl-device as their current CUDA device (per thread; it starts at 0), and a
group builds its communicator while both peers are in the rendezvous."""

from __future__ import annotations

import threading

import pytest
import torch

from services.transfer.domain import TransferBackend
from services.transfer.pair_channel import create_group
from services.transfer.threads import TransferThreads

pytestmark = pytest.mark.timeout(10)


def _devices_set(monkeypatch, nccl_device: torch.device | None) -> set[tuple[str, torch.device]]:
    """(thread name prefix, device) of each torch.cuda.set_device call (recorded: no GPU here) once every pool ran."""
    calls: set[tuple[str, torch.device]] = set()
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.add((threading.current_thread().name.rsplit("_", 1)[0], device)))
    threads = TransferThreads.start(1, nccl_device)
    try:
        for pool in (threads.copy, threads.io, threads.rendezvous):
            pool.submit(lambda: None).result(timeout=5)
    finally:
        threads.shutdown()
    return calls


def test_nccl_channel_threads_make_the_nccl_device_current(monkeypatch):
    device = torch.device("cuda", 1)
    assert _devices_set(monkeypatch, device) == {("kv-io", device), ("kv-rendezvous", device)}


def test_without_nccl_no_thread_touches_cuda(monkeypatch):
    assert _devices_set(monkeypatch, None) == set()


def test_an_nccl_group_builds_its_communicator_in_the_rendezvous(monkeypatch):
    """Not lazily in the first send or recv, which no wait timeout bounds (recorded: no NCCL here)."""
    connected: list[torch.device] = []

    class RecordingNccl:
        Options = type("Options", (), {})

        def __init__(self, store, rank, size, options) -> None:
            self.timeout_s = options._timeout.total_seconds()

        def eager_connect_single_device(self, device: torch.device) -> None:
            connected.append(device)

    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", RecordingNccl, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    group = create_group(TransferBackend.NCCL, store=None, rank=0, host="127.0.0.1", timeout_s=7.0,
                         num_connections=1)
    assert connected == [torch.device("cuda", 1)] and group.timeout_s == 7.0
