"""The instances whose KV shared memory this transfer service has mapped."""

from __future__ import annotations

import structlog

from services.common.errors import NotFound
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.transfer.block_copy import kv_rows
from services.transfer.domain import InstanceId

log = structlog.get_logger(__name__)


class KvMappings:
    def __init__(self, transfer_id: str) -> None:
        self._transfer_id = transfer_id
        self._caches: dict[InstanceId, KvCache] = {}

    def map(self, instance_id: InstanceId, shm_name: str, geometry: KvGeometry) -> KvCache:
        """Map (or re-map, e.g. after an instance restart) the instance's KV segment."""
        cache = KvCache.attach(shm_name, geometry)  # NotFound / InvalidArgument with a fix in the message
        previous = self._caches.get(instance_id)
        self._caches[instance_id] = cache
        if previous is not None:
            previous.close()  # transfers in flight keep their own views alive
        log.info("instance_mapped", instance_id=instance_id, shm_name=shm_name, num_blocks=geometry.num_blocks,
                 num_bytes=geometry.num_bytes)
        return cache

    def unmap(self, instance_id: InstanceId) -> bool:
        cache = self._caches.pop(instance_id, None)
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

    def rows(self, instance_id: InstanceId):
        """The instance's KV as `[layers * 2, blocks, row_elems]`, and its geometry."""
        cache = self.get(instance_id)
        return kv_rows(cache.tensor), cache.geometry

    def instance_ids(self) -> list[InstanceId]:
        return sorted(self._caches)

    def close(self) -> None:
        for instance_id in list(self._caches):
            self.unmap(instance_id)
