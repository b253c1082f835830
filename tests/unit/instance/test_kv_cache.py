"""KvCache: named shared memory that another process maps by name; no leaked segments."""

import os
import resource
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from services.common.errors import Internal, InvalidArgument, NotFound, ResourceExhausted
from services.instance.engine.kv_cache import SHM_DIR, KvCache, KvGeometry
from tests.torch_children import TORCH_CHILD_TIMEOUT_S

pytestmark = pytest.mark.timeout(TORCH_CHILD_TIMEOUT_S + 60)  # one child at most, but for the test that marks its own

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=8, dtype=torch.float32)


@pytest.fixture
def name():
    name = f"ferry-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    assert not (SHM_DIR / name).exists(), f"leaked {SHM_DIR / name}"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TORCH_CHILD_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, check=False)


def test_geometry_sizes():
    assert GEOMETRY.shape == (2, 2, 8, 4, 2, 4)
    assert GEOMETRY.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4
    assert GEOMETRY.num_bytes == GEOMETRY.bytes_per_block * 8
    assert GEOMETRY.dtype_name == "float32"
    assert KvGeometry.from_dtype_name("bfloat16", num_layers=1, num_kv_heads=1, head_dim=2, block_size=1,
                                      num_blocks=1).dtype is torch.bfloat16
    with pytest.raises(InvalidArgument, match="num_blocks"):
        KvGeometry(1, 1, 1, 1, 0, torch.float32)


def test_create_is_zeroed_and_unlink_removes_the_name(name):
    cache = KvCache.create(name, GEOMETRY)
    assert cache.tensor.shape == GEOMETRY.shape and cache.tensor.dtype == torch.float32
    assert (SHM_DIR / name).stat().st_size == GEOMETRY.num_bytes
    assert not cache.tensor.any()
    view = cache.tensor[1, 0, 3]
    cache.unlink()
    assert not (SHM_DIR / name).exists()
    view.fill_(1.0)  # mappings stay valid after unlink and close
    cache.close()
    assert view.sum().item() == GEOMETRY.block_size * GEOMETRY.num_kv_heads * GEOMETRY.head_dim
    cache.unlink()  # idempotent


def test_another_process_attaches_by_name_and_shares_bytes(name):
    with KvCache.create(name, GEOMETRY) as cache:
        cache.tensor[0, 1, 5] = 3.0
        code = (
            "import torch\n"
            "from services.instance.engine.kv_cache import KvCache, KvGeometry\n"
            f"g = KvGeometry(2, 2, 4, 4, 8, torch.float32)\n"
            f"c = KvCache.attach({name!r}, g)\n"
            "assert not c.is_owner\n"
            "print(c.tensor[0, 1, 5].sum().item())\n"
            "c.tensor[1, 0, 2] = 5.0\n"
            "c.close(); c.unlink()\n"
        )
        result = run_python(code)
        assert result.returncode == 0, result.stderr
        assert float(result.stdout) == 3.0 * 4 * 2 * 4
        assert (cache.tensor[1, 0, 2] == 5.0).all()
        assert (SHM_DIR / name).exists()  # the attaching process neither unlinked nor tracked it


def test_attach_errors(name):
    with pytest.raises(NotFound, match=name):
        KvCache.attach(name, GEOMETRY)
    with KvCache.create(name, GEOMETRY):
        bigger = KvGeometry(2, 2, 4, 4, 16, torch.float32)
        with pytest.raises(InvalidArgument, match="geometry"):
            KvCache.attach(name, bigger)
        with pytest.raises(Internal, match="already exists"):
            KvCache.create(name, GEOMETRY)


def test_creator_exit_removes_the_segment(name):
    code = (
        "import torch\n"
        "from services.instance.engine.kv_cache import KvCache, KvGeometry\n"
        f"KvCache.create({name!r}, KvGeometry(2, 2, 4, 4, 8, torch.float32))\n"
        "print('created')\n"
    )
    result = run_python(code)
    assert result.returncode == 0 and "created" in result.stdout, result.stderr
    assert "leaked" not in result.stderr


def test_killed_creator_is_cleaned_up_by_the_resource_tracker(name):
    code = (
        "import sys, time, torch\n"
        "from services.instance.engine.kv_cache import KvCache, KvGeometry\n"
        f"KvCache.create({name!r}, KvGeometry(2, 2, 4, 4, 8, torch.float32))\n"
        "print('created', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == "created"  # bounded by the test's timeout
        assert (SHM_DIR / name).exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while (SHM_DIR / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (SHM_DIR / name).exists(), "the resource tracker left the killed creator's segment behind"


def test_a_cache_larger_than_the_free_shared_memory_is_refused_and_leaves_nothing(name):
    # Larger than all of SHM_DIR, not just than what is free now: a parallel test worker that frees a
    # segment meanwhile must not make it fit (it would then reserve every free page of the host's tmpfs).
    stats = os.statvfs(SHM_DIR)
    all_blocks = stats.f_blocks * stats.f_frsize // GEOMETRY.bytes_per_block
    too_big = KvGeometry(2, 2, 4, 4, all_blocks + 1024, torch.float32)
    with pytest.raises(ResourceExhausted, match="lower --kv-cache-mib"):
        KvCache.create(name, too_big)


def test_every_page_of_a_new_cache_is_allocated_up_front(name):
    with KvCache.create(name, GEOMETRY) as cache:
        assert os.stat(SHM_DIR / cache.name).st_blocks * 512 >= GEOMETRY.num_bytes  # not a sparse file


def _minor_faults_reading(tensor: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor.sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_prefaulted_mapping_reads_pages_another_process_wrote_without_faulting_them(name):
    # 16 MiB: 4096 pages. The owner writes them through its mapping (as a transfer service
    # writes migrated blocks); a second, fresh mapping then faults on the first read of them
    # (16 pages a fault with the kernel's default fault-around) unless it was prefaulted.
    geometry = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=512,
                          dtype=torch.float32)
    with KvCache.create(name, geometry) as writer:
        writer.tensor.fill_(0.25)
        lazy, prefaulted = KvCache.attach(name, geometry), KvCache.attach(name, geometry)
        if not prefaulted.prefault():
            pytest.skip("needs Linux >= 5.14 (MADV_POPULATE_WRITE)")
        torch.set_num_threads(1)
        assert _minor_faults_reading(prefaulted.tensor) < 32
        assert _minor_faults_reading(lazy.tensor) > 128
        assert float(prefaulted.tensor.sum()) == 0.25 * prefaulted.tensor.numel()  # the data is untouched


def test_prefault_in_background_finishes_and_a_gpu_or_closed_cache_is_left_alone(name):
    with KvCache.create(name, GEOMETRY) as cache:
        thread = cache.prefault_in_background()
        thread.join(10)
        assert not thread.is_alive()
        cache.close()
        assert not cache.prefault()  # nothing mapped any more


@pytest.mark.timeout(2 * TORCH_CHILD_TIMEOUT_S + 60)
def test_a_process_that_exits_while_prefaulting_exits_cleanly(name):
    # As a daemon thread, a prefault still inside madvise when the process closed its cache and
    # exited aborted it ("terminate called without an active exception", exit status -6).
    code = f"""
import torch
from services.instance.engine.kv_cache import KvCache, KvGeometry
geometry = KvGeometry(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=4096, dtype=torch.float32)
for i in range(2):
    with KvCache.create(f"{name}-{{i}}", geometry) as cache:  # 256 MiB: the prefault runs on at close
        cache.prefault_in_background()
"""
    for _ in range(2):
        completed = run_python(code)
        assert completed.returncode == 0, completed.stderr[-2000:]
        assert not list(SHM_DIR.glob(f"{name}-*"))
