import uuid

import pytest
import torch

from services.common.errors import NotFound
from services.instance.engine.kv_cache import KvCache
from services.transfer.kv_mappings import KvMappings
from tests.unit.transfer.factories import tiny_geometry

pytestmark = pytest.mark.timeout(30)


def test_map_sees_the_instances_bytes_and_unmap_forgets_it():
    geometry = tiny_geometry()
    with KvCache.create(f"ferry-unit-{uuid.uuid4().hex[:8]}", geometry) as cache:
        cache.tensor.fill_(1.5)
        mappings = KvMappings("t-0")
        mapped = mappings.map("inst-0", cache.name, geometry)
        assert mappings.wait_prefaulted("inst-0", 10)
        assert torch.equal(mapped.tensor, cache.tensor)
        rows, mapped_geometry = mappings.rows("inst-0")
        rows[:, 3].fill_(2.0)  # writes through the shared memory
        assert bool((cache.tensor[:, :, 3] == 2.0).all()) and mapped_geometry == geometry
        assert mappings.instance_ids() == ["inst-0"]
        assert mappings.unmap("inst-0") and not mappings.unmap("inst-0")
        with pytest.raises(NotFound, match="MapInstance"):
            mappings.get("inst-0")
