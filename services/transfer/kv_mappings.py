"""The instances whose KV memory this transfer service has mapped: host shared memory by name,
or GPU memory through a CUDA IPC handle."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import structlog
import torch

from services.common.errors import NotFound
from services.instance.engine.cuda_ipc import CudaIpcHandle
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.transfer.block_copy import kv_rows
from services.transfer.domain import InstanceId
from services.transfer.write_grants import WriteGrants

log = structlog.get_logger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fill the page tables, writable, without touching the data
_PAGE = 4096


class KvMappings:
    def __init__(self, transfer_id: str) -> None:
        self._transfer_id = transfer_id
        self._caches: dict[InstanceId, KvCache] = {}
        self._rows: dict[InstanceId, torch.Tensor] = {}  # each cache as rows, viewed once (a view costs µs per transfer)
        self._prefaults: dict[InstanceId, threading.Thread] = {}  # one short-lived thread per map
        self.write_grants = WriteGrants()  # which writes into these caches are allowed (the migration fence)

    def map(self, instance_id: InstanceId, shm_name: str, geometry: KvGeometry,
            cuda_ipc: CudaIpcHandle | None = None) -> KvCache:
        """Map (or re-map, e.g. after an instance restart) the instance's KV segment, or its GPU
        memory where `cuda_ipc` is given."""
        if cuda_ipc is not None:
            cache = KvCache.open_ipc(shm_name, geometry, cuda_ipc)  # FailedPrecondition without that GPU
            self._prefaults.pop(instance_id, None)  # device memory: nothing to pre-fault
        else:
            cache = KvCache.attach(shm_name, geometry)  # NotFound / InvalidArgument with a fix in the message
            # Pre-fault in the background: seconds for a big cache, and a transfer meanwhile just
            # faults the pages it touches itself.
            thread = threading.Thread(target=populate, args=(cache.tensor,), name=f"prefault-{instance_id}",
                                      daemon=True)
            thread.start()
            self._prefaults[instance_id] = thread
        previous = self._caches.get(instance_id)
        if previous is not None:  # maybe a restarted instance under the same id (and, in a container, pid)
            self.write_grants.revoke_all(instance_id)  # its predecessor's grants must not write into it
        self._caches[instance_id] = cache
        self._rows[instance_id] = kv_rows(cache.tensor)
        if previous is not None:
            previous.close()  # transfers in flight keep their own views alive
        log.info("instance_mapped", instance_id=instance_id, shm_name=shm_name, device=str(cache.tensor.device),
                 num_blocks=geometry.num_blocks, num_bytes=geometry.num_bytes)
        return cache

    def wait_prefaulted(self, instance_id: InstanceId, timeout_s: float) -> bool:
        thread = self._prefaults.get(instance_id)
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def unmap(self, instance_id: InstanceId) -> bool:
        self._prefaults.pop(instance_id, None)
        cache = self._caches.pop(instance_id, None)
        self._rows.pop(instance_id, None)
        self.write_grants.revoke_all(instance_id)  # whatever maps this id next is another memory
        self.write_grants.unfence(instance_id)
        if cache is None:
            return False
        cache.close()
        log.info("instance_unmapped", instance_id=instance_id)
        return True

    def get(self, instance_id: InstanceId) -> KvCache:
        cache = self._caches.get(instance_id)
        if cache is None:
            raise NotFound(f"instance {instance_id!r} is not mapped by transfer service {self._transfer_id!r}; "
                           "call MapInstance on it first (or start it with --map-instances)")
        return cache

    def rows(self, instance_id: InstanceId) -> tuple[torch.Tensor, KvGeometry]:
        """The instance's KV as `[layers * 2, blocks, row_elems]`, and its geometry."""
        cache = self.get(instance_id)
        return self._rows[instance_id], cache.geometry

    def instance_ids(self) -> list[InstanceId]:
        return sorted(self._caches)

    def close(self) -> None:
        for instance_id in list(self._caches):
            self.unmap(instance_id)


def populate(tensor: torch.Tensor) -> bool:
    """Pre-fault a fresh mapping so transfers do not pay page faults (writes into a fresh
    mapping measured 2.4 GB/s against 8 GB/s); ~4 GB/s, so seconds for a big cache.
    Returns False where the kernel lacks MADV_POPULATE_WRITE (transfers then fault lazily)."""
    start = tensor.data_ptr() // _PAGE * _PAGE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
