"""CUDA IPC handles: how an instance lends its KV cache on a GPU to the co-located transfer service.

The instance allocates the cache on its device and exports it (`export_handle`): the
cudaIpcMemHandle of the allocation that holds it, where the tensor starts in it, and the
producer's reference counter, as torch's own `multiprocessing` reductions produce them.
The transfer service opens the handle (`open_handle`) and gets a tensor over the same
device memory, so gathers and scatters read and write the instance's blocks in place.

The handle names the GPU by its UUID, not its index: the two processes may see the GPUs
in different orders (CUDA_VISIBLE_DEVICES), and an index would open the wrong one.
The instance keeps its cache for its whole life, so the memory stays valid while the
transfer service has it mapped. Nothing here is pickled: the fields travel as plain
protobuf fields, and only torch's rebuild function sees them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.common.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    device_uuid: str  # the GPU, as torch.cuda.get_device_properties(i).uuid prints it
    storage_handle: bytes  # cudaIpcMemHandle of the allocation holding the tensor
    storage_size_bytes: int
    storage_offset_bytes: int  # where the storage starts in that allocation
    ref_counter_handle: bytes  # the producer's shared reference counter (torch's CudaIPCSentData)
    ref_counter_offset: int
    event_handle: bytes  # recorded by the producer; the consumer waits on it before first use
    event_sync_required: bool
    tensor_offset: int  # elements from the storage's start to the tensor's first element


def export_handle(tensor: torch.Tensor) -> CudaIpcHandle:
    """The handle of a contiguous CUDA tensor (the KV cache), for another process on this host."""
    if tensor.device.type != "cuda":
        raise InvalidArgument(f"a CUDA IPC handle needs a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise InvalidArgument("a CUDA IPC handle needs a contiguous tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device_index, storage_handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcHandle(device_uuid(device_index), bytes(storage_handle), int(storage_size_bytes),
                         int(storage_offset_bytes), bytes(ref_counter_handle), int(ref_counter_offset),
                         bytes(event_handle or b""), bool(event_sync_required), int(tensor_offset))


def open_handle(handle: CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `shape` over the memory `handle` names (raises FailedPrecondition without CUDA)."""
    device_index = local_device_index(handle.device_uuid)
    numel = math.prod(shape)
    if (handle.tensor_offset + numel) * dtype.itemsize > handle.storage_size_bytes:
        raise InvalidArgument(f"the CUDA IPC handle holds {handle.storage_size_bytes} bytes, the KV geometry needs "
                              f"{numel * dtype.itemsize} from element {handle.tensor_offset}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    stride = torch.empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), stride, handle.tensor_offset, torch.storage.TypedStorage, dtype,
        device_index, handle.storage_handle, handle.storage_size_bytes, handle.storage_offset_bytes, False,
        handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle or None,
        handle.event_sync_required)


def device_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    if not torch.cuda.is_available():
        raise FailedPrecondition("the instance's KV cache is on a GPU (CUDA IPC handle), but this transfer service "
                                 f"sees no CUDA device (torch {torch.__version__}); run it on the instance's host "
                                 "with CUDA")
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise FailedPrecondition(f"GPU {uuid} is not visible to this transfer service "
                             f"({torch.cuda.device_count()} visible); give it the instance's GPUs "
                             "(CUDA_VISIBLE_DEVICES)")
