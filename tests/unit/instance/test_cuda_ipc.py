"""CUDA IPC handles of a KV cache on a GPU: their wire form, the refusals, and (with CUDA) another
process writing into the cache through one."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from services.cluster.processes import child_python_path
from services.common.errors import InvalidArgument
from services.common.gen.ferry.v1 import transfer_pb2
from services.instance.engine.cuda_ipc import CudaIpcHandle, export_handle
from services.instance.engine.kv_cache import SHM_DIR, KvCache, KvGeometry, segment_file_id
from services.transfer.convert import ipc_handle_from_proto, ipc_handle_to_proto

pytestmark = pytest.mark.timeout(120)

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=6, dtype=torch.float16)
HANDLE = CudaIpcHandle("GPU-1b2c", b"\x07" * 64, 1 << 20, 512, b"/torch_ref_1", 8, b"\x03" * 64, True, 16)


def test_a_handle_survives_its_wire_form_byte_for_byte():
    wire = transfer_pb2.CudaIpcHandle.FromString(ipc_handle_to_proto(HANDLE).SerializeToString())
    assert ipc_handle_from_proto(wire) == HANDLE


@pytest.mark.parametrize("field, value", [("device_uuid", ""), ("storage_handle", b""), ("storage_size_bytes", 0),
                                          ("tensor_offset", -1), ("storage_offset_bytes", -4)])
def test_an_incomplete_handle_is_invalid_argument_naming_cuda_ipc(field, value):
    wire = ipc_handle_to_proto(HANDLE)
    setattr(wire, field, value)
    with pytest.raises(InvalidArgument, match="cuda_ipc"):
        ipc_handle_from_proto(wire)


def test_only_a_contiguous_cuda_tensor_has_a_handle():
    with pytest.raises(InvalidArgument, match="needs a CUDA tensor"):
        export_handle(torch.zeros(4))


def test_a_host_cache_has_no_handle():
    cache = KvCache.create(f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", GEOMETRY)
    try:
        assert cache.ipc_handle is None and cache.tensor.device.type == "cpu"
    finally:
        cache.close()
        cache.unlink()


WRITER = """
import sys, torch
from services.common.gen.ferry.v1 import transfer_pb2
from services.instance.engine.kv_cache import SHM_DIR, KvCache, KvGeometry, segment_file_id
from services.transfer.convert import ipc_handle_from_proto
geometry = KvGeometry(2, 2, 8, 4, 6, torch.float16)
handle = ipc_handle_from_proto(transfer_pb2.CudaIpcHandle.FromString(sys.stdin.buffer.read()))
cache = KvCache.open_ipc(sys.argv[1], geometry, handle)
assert not cache.is_name_gone  # the producer's marker segment names it while the producer lives
assert torch.equal(cache.tensor[1, 0, 3], torch.full_like(cache.tensor[1, 0, 3], 7))  # the producer's write
cache.tensor[0, 1, 2].fill_(5)
torch.cuda.synchronize()
print(cache.tensor.device)
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_another_process_reads_and_writes_the_cache_through_its_handle():
    name = f"ferry-kv-gpu-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = KvCache.create(name, GEOMETRY, torch.device("cuda", 0))
    assert (SHM_DIR / name).stat().st_size >= 1  # the marker only: the cache itself is on the GPU
    cache.tensor[1, 0, 3].fill_(7)
    torch.cuda.synchronize()
    wire = ipc_handle_to_proto(cache.ipc_handle).SerializeToString()
    done = subprocess.run([sys.executable, "-c", WRITER, name], input=wire, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": child_python_path()}, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().startswith("cuda")
    assert torch.equal(cache.tensor[0, 1, 2], torch.full_like(cache.tensor[0, 1, 2], 5))
    assert int(cache.tensor.count_nonzero()) == 2 * GEOMETRY.block_size * GEOMETRY.num_kv_heads * GEOMETRY.head_dim
    cache.close()
    cache.unlink()
    assert not (SHM_DIR / name).exists()


def test_a_mapping_is_found_gone_once_its_creators_segment_name_goes():
    # what lets a transfer service release a dead GPU instance's memory: open_ipc records the
    # marker segment's identity, and the instance's successor on the host reclaims the name
    name = f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with KvCache.create(name, GEOMETRY):
        mapped = KvCache(name, GEOMETRY, torch.zeros(1), owner=None, file_id=segment_file_id(name))
        assert mapped.file_id is not None and not mapped.is_name_gone
    assert mapped.is_name_gone
    assert segment_file_id(name) is None and segment_file_id("../etc/passwd") is None
