"""The instances whose KV memory this transfer service has mapped: host shared memory by name,
or GPU memory through a CUDA IPC handle."""

from __future__ import annotations

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
            self._prefaults[instance_id] = cache.prefault_in_background()
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
            log.info("instance_unmap_not_mapped", instance_id=instance_id, transfer_id=self._transfer_id,
                     mapped_instance_ids=self.instance_ids())
            return False
        shm_name, device = cache.name, str(cache.tensor.device)
        cache.close()
        log.info("instance_unmapped", instance_id=instance_id, shm_name=shm_name, device=device,
                 transfer_id=self._transfer_id)
        return True

    def unmap_vanished(self) -> list[InstanceId]:
        """Unmap the instances whose segment name went away or names a new segment now. A killed
        instance cannot unmap itself, and nothing else would ever let go of its memory (the whole KV
        cache, in /dev/shm) unless an instance came back under its id."""
        vanished = [instance_id for instance_id, cache in self._caches.items() if cache.is_name_gone]
        for instance_id in vanished:
            log.warning("instance_segment_vanished", instance_id=instance_id, shm_name=self._caches[instance_id].name,
                        reason="its instance is gone: the segment's name was removed or reused")
            self.unmap(instance_id)
        return vanished

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
