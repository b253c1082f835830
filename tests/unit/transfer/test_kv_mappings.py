import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from services.common.errors import InvalidArgument, NotFound
from services.instance.engine.kv_cache import SHM_DIR, KvCache
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


def _mapped_deleted_files() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


def test_an_instance_killed_without_unmapping_is_unmapped_once_its_segment_name_is_gone():
    """A SIGKILLed instance cannot unmap itself; its resource tracker (or the next instance on the host)
    removes the segment's name, but the service kept the whole KV cache mapped, and listed the instance,
    for as long as it ran (unless an instance came back under the same id)."""
    geometry = tiny_geometry()
    name = f"ferry-unit-{uuid.uuid4().hex[:8]}"
    # The segment made as KvCache.create makes it (its resource tracker unlinks it once the creator is killed),
    # by a child that imports no torch: that took a loaded machine longer than this test's bounds.
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from multiprocessing import shared_memory\n"
        f"shared_memory.SharedMemory({name!r}, create=True, size={geometry.num_bytes})\n"
        "print('created', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "created\n"
        with KvCache.create(f"ferry-unit-{uuid.uuid4().hex[:8]}", geometry) as live:
            mappings = KvMappings("t-0")
            mappings.map("killed", name, geometry)
            mappings.map("live", live.name, geometry)
            assert mappings.wait_prefaulted("killed", 10) and mappings.unmap_vanished() == []
            child.send_signal(signal.SIGKILL)
            child.wait()
            deadline = time.monotonic() + 20
            while (SHM_DIR / name).exists():  # its resource tracker unlinks it
                assert time.monotonic() < deadline, "the killed creator's resource tracker left its segment"
                time.sleep(0.05)
            assert f"{name} (deleted)" in _mapped_deleted_files()  # the memory is still held here
            assert mappings.unmap_vanished() == ["killed"]
            assert mappings.instance_ids() == ["live"]
            assert f"{name} (deleted)" not in _mapped_deleted_files()
            mappings.close()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        (SHM_DIR / name).unlink(missing_ok=True)


def test_a_mapping_whose_name_now_names_a_new_segment_is_unmapped_and_a_fresh_mapping_is_kept():
    """An instance restarted as PID 1 of its container creates a segment under the same name."""
    geometry = tiny_geometry()
    name = f"ferry-unit-{uuid.uuid4().hex[:8]}"
    mappings = KvMappings("t-0")
    with KvCache.create(name, geometry):
        mappings.map("inst-0", name, geometry)
    with KvCache.create(name, geometry):
        assert mappings.unmap_vanished() == ["inst-0"]
        mappings.map("inst-0", name, geometry)  # the new instance maps itself
        assert mappings.unmap_vanished() == [] and mappings.instance_ids() == ["inst-0"]
        mappings.close()


def test_unmap_logs_name_the_instance_its_segment_and_the_service_or_say_it_was_not_mapped():
    """UnmapInstance logged only the instance id when it unmapped one, and nothing at all when the
    instance was not mapped there: an operator could not tell which segment went, or that it was not there."""
    from structlog.testing import capture_logs

    geometry = tiny_geometry()
    with KvCache.create(f"ferry-unit-{uuid.uuid4().hex[:8]}", geometry) as cache:
        mappings = KvMappings("t-0")
        mappings.map("inst-0", cache.name, geometry)
        with capture_logs() as logs:
            assert mappings.unmap("inst-0") and not mappings.unmap("inst-0")
    unmapped, not_mapped = logs
    assert unmapped["event"] == "instance_unmapped" and unmapped["instance_id"] == "inst-0"
    assert unmapped["shm_name"] == cache.name and unmapped["transfer_id"] == "t-0"
    assert not_mapped["event"] == "instance_unmap_not_mapped" and not_mapped["instance_id"] == "inst-0"
    assert not_mapped["transfer_id"] == "t-0"
