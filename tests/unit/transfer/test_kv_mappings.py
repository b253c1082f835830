import uuid

import pytest
import torch

from services.common.errors import InvalidArgument, NotFound
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


@pytest.mark.parametrize("make_name", [lambda victim: f"../..{victim}", lambda victim: f"ferry-kv-x/../../..{victim}",
                                       lambda victim: victim.name])
def test_a_name_that_is_not_a_kv_segment_is_refused_and_no_file_is_mapped(tmp_path, make_name):
    """MapInstance's shm_name comes from a peer: before, `../../<path>` mapped any file the service could
    open read-write, and a transfer into that "instance" overwrote it."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"x" * tiny_geometry().num_bytes)
    with pytest.raises(InvalidArgument, match="shm_name: .* is not a KV segment name"):
        KvMappings("t-0").map("inst-0", make_name(victim), tiny_geometry())
    assert victim.read_bytes() == b"x" * tiny_geometry().num_bytes
