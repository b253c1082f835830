"""The paged KV cache: one tensor in named shared memory that other processes can map.

Layout `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (dim 1: 0 = K,
1 = V). The instance creates it (`KvCache.create`); the co-located transfer service
maps the same bytes by name (`KvCache.attach`) and reads/writes blocks in place.

The segment is a POSIX shared memory object (`/dev/shm/<name>`, Linux). It is created
with `multiprocessing.shared_memory` (fresh pages read as zeros) and mapped with
`torch.from_file(..., shared=True)`, so the mapping lives exactly as long as the
tensor and its views: closing never leaves a tensor pointing at unmapped memory.
Only the creator unlinks the name: explicitly with `unlink()`, at interpreter exit,
and, if the process is killed, through multiprocessing's resource tracker.

On a GPU (`create(..., device=cuda:N)`) the cache is plain device memory instead, and the
transfer service maps it through a CUDA IPC handle (`ipc_handle`, `open_ipc`; cuda_ipc.py).
Its `name` then only names it in logs.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import torch

from services.common.errors import Internal, InvalidArgument, NotFound, ResourceExhausted
from services.instance.engine.cuda_ipc import CudaIpcHandle, export_handle, open_handle

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "ferry-"  # every KV segment's name starts so (instances: ferry-kv-<host>-<pid>)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fill the page tables, writable, without touching the data
_PAGE = 4096
_PREFAULT_CHUNK_BYTES = 64 << 20  # ~16 ms a madvise: how soon `close` stops a prefault in progress
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise InvalidArgument(f"kv dtype: {self.dtype} is not supported; use {', '.join(DTYPE_NAMES.values())}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"kv geometry: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_dtype_name(cls, dtype_name: str, **fields: int) -> KvGeometry:
        by_name = {name: dtype for dtype, name in DTYPE_NAMES.items()}
        if dtype_name not in by_name:
            raise InvalidArgument(f"kv dtype: {dtype_name!r} is not supported; use {', '.join(by_name)}")
        return cls(dtype=by_name[dtype_name], **fields)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (not contiguous in the layout)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


class KvCache:
    """A KV tensor in named shared memory (or on a GPU). Use `create` (owner), `attach` or `open_ipc`."""

    def __init__(self, name: str, geometry: KvGeometry, tensor: torch.Tensor,
                 owner: shared_memory.SharedMemory | None, ipc_handle: CudaIpcHandle | None = None,
                 file_id: tuple[int, int] | None = None) -> None:
        self.name = name
        self.geometry = geometry
        self.tensor = tensor
        self.ipc_handle = ipc_handle  # set for a cache on a GPU: how other processes map it
        self.file_id = file_id  # (st_dev, st_ino) of the segment an attached cache mapped
        self._owner = owner  # set in the creating process only; it alone unlinks the name
        self._closed = threading.Event()

    @classmethod
    def create(cls, name: str, geometry: KvGeometry, device: torch.device | None = None) -> KvCache:
        """Create the segment `name`, zero-filled, and map it; on a CUDA `device`, zeroed device memory."""
        if device is not None and device.type == "cuda":
            tensor = torch.zeros(geometry.shape, dtype=geometry.dtype, device=device)
            marker = _create_segment(name, 1)  # the name only: while it is there, this process lives (open_ipc)
            cache = cls(name, geometry, tensor, owner=marker, ipc_handle=export_handle(tensor))
            atexit.register(cache.unlink)
            return cache
        _check_shm_room(geometry.num_bytes)
        shm = _create_segment(name, geometry.num_bytes)
        try:
            _reserve(SHM_DIR / name, geometry.num_bytes)
        except BaseException:
            shm.unlink()
            raise
        cache = cls(name, geometry, _map(name, geometry), owner=shm)
        atexit.register(cache.unlink)
        return cache

    @classmethod
    def attach(cls, name: str, geometry: KvGeometry) -> KvCache:
        """Map the existing segment `name` created with the same `geometry`."""
        _check_segment_name(name)
        path = SHM_DIR / name
        if not path.exists():
            raise NotFound(f"no KV cache shared memory named {name!r} ({path}); is the instance running?")
        stat = path.stat()
        if stat.st_size < geometry.num_bytes:
            raise InvalidArgument(
                f"KV cache {name!r} has {stat.st_size} bytes but the geometry needs {geometry.num_bytes}; "
                "attach with the geometry the instance registered"
            )
        return cls(name, geometry, _map(name, geometry), owner=None, file_id=(stat.st_dev, stat.st_ino))

    @property
    def is_name_gone(self) -> bool:
        """Whether an attached segment's name no longer names the memory mapped here: its creator
        is gone (the name was unlinked when it died, or taken by a new segment since)."""
        if self.file_id is None:
            return False
        try:
            stat = (SHM_DIR / self.name).stat()
        except FileNotFoundError:
            return True
        return (stat.st_dev, stat.st_ino) != self.file_id

    @classmethod
    def open_ipc(cls, name: str, geometry: KvGeometry, handle: CudaIpcHandle) -> KvCache:
        """Map another process's cache on a GPU through its CUDA IPC handle. The creator keeps a
        one-byte segment under `name` (`create`): once a successor on the host reclaims it, the
        cache `is_name_gone` and the transfer service lets go of the dead instance's GPU memory,
        which its mapping would otherwise hold for as long as it lives."""
        return cls(name, geometry, open_handle(handle, geometry.shape, geometry.dtype), owner=None, ipc_handle=handle,
                   file_id=segment_file_id(name))

    @property
    def is_owner(self) -> bool:
        return self._owner is not None

    def prefault(self) -> bool:
        """Fill this process's page tables for the whole mapping. A fresh mapping faults on the first
        touch of each 4 KiB page: blocks another process wrote (a migration's, through the transfer
        service) cost the first decode step that reads them ~1 ms per 16 MiB, and writes into a fresh
        mapping measured 2.4 GB/s against 8 GB/s. ~4 GB/s, so seconds for a big cache; done a chunk at
        a time, and `close` stops it between chunks. False if stopped, on a GPU, or where the kernel
        lacks MADV_POPULATE_WRITE (pages then fault lazily)."""
        tensor = self.tensor  # keeps the mapping alive should `close` drop ours meanwhile
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        start = tensor.data_ptr() // _PAGE * _PAGE
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        libc = _libc()
        for chunk in range(start, end, _PREFAULT_CHUNK_BYTES):
            length = min(_PREFAULT_CHUNK_BYTES, end - chunk)
            if self._closed.is_set() or libc.madvise(ctypes.c_void_p(chunk), ctypes.c_size_t(length),
                                                     _MADV_POPULATE_WRITE) != 0:
                return False
        return True

    def prefault_in_background(self) -> threading.Thread:
        """`prefault` on a thread of its own (madvise releases the GIL); whoever touches a page first
        meanwhile just faults it. Not a daemon: one cut off at interpreter exit inside madvise
        aborted the process ("terminate called without an active exception")."""
        thread = threading.Thread(target=self.prefault, name=f"prefault-{self.name}")
        thread.start()
        return thread

    def close(self) -> None:
        """Drop this object's mapping (views others hold stay valid until they are dropped)."""
        self._closed.set()  # a prefault in progress stops at its next chunk
        self.tensor = torch.empty(0, dtype=self.geometry.dtype)

    def unlink(self) -> None:
        """Remove the name (creator only); existing mappings stay valid. Idempotent."""
        if self._owner is None:
            return
        owner, self._owner = self._owner, None
        atexit.unregister(self.unlink)
        try:
            owner.unlink()  # also unregisters it from the resource tracker
        except FileNotFoundError:
            resource_tracker.unregister(owner._name, "shared_memory")  # type: ignore[attr-defined]

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


def _check_segment_name(name: str) -> None:
    """A KV segment is a file of ferry's directly in SHM_DIR: a name from a peer (MapInstance's shm_name,
    an etcd record) must not reach any other file, which attaching maps read-write."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name or "\0" in name:
        raise InvalidArgument(f"shm_name: {name!r} is not a KV segment name (one file name in {SHM_DIR} "
                              f"starting with {SEGMENT_PREFIX!r})")


_SHM_ADVICE = f"lower --kv-cache-mib (or --num-blocks), or give {SHM_DIR} more room (docker: --shm-size)"


def _create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """Create the shared memory segment `name` of `size` bytes (closed here: the name stays)."""
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        raise Internal(
            f"shared memory {name!r} already exists: another process uses that name, or one that crashed "
            f"left {SHM_DIR / name} behind (remove it)"
        ) from None
    shm.close()  # torch maps the bytes itself, where there are any to map
    return shm


def segment_file_id(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the segment `name`, or None where there is none (an older instance on a
    GPU kept no marker: its mapping is then never found vanished)."""
    try:
        _check_segment_name(name)
        stat = (SHM_DIR / name).stat()
    except (InvalidArgument, FileNotFoundError):
        return None
    return stat.st_dev, stat.st_ino


def _check_shm_room(num_bytes: int) -> None:
    """tmpfs hands out a segment larger than its free space and the process dies of SIGBUS when
    it touches the pages that are not there: refuse up front instead."""
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if num_bytes > free:
        raise ResourceExhausted(
            f"the KV cache needs {num_bytes / 2**20:.0f} MiB of shared memory but {SHM_DIR} has "
            f"{free / 2**20:.0f} MiB free; {_SHM_ADVICE}")


def _reserve(path: Path, num_bytes: int) -> None:
    """Allocate every page of the segment now, so that running short of memory is a clear error
    at startup, not a SIGBUS on the first write to a page tmpfs could not give."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        raise ResourceExhausted(f"cannot reserve the KV cache's {num_bytes / 2**20:.0f} MiB in {SHM_DIR} "
                                f"({exc.strerror}); {_SHM_ADVICE}") from None
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _map(name: str, geometry: KvGeometry) -> torch.Tensor:
    numel = geometry.num_bytes // geometry.dtype.itemsize
    flat = torch.from_file(os.fspath(SHM_DIR / name), shared=True, size=numel, dtype=geometry.dtype)
    return flat.view(geometry.shape)
