"""Keep freed heap memory for reuse, so big short-lived buffers do not land on fresh pages.

A grpc transfer allocates and frees one `bytes` per message (1 MiB by default) on each
side (the sender's gathered message, grpc-core's slices, the receiver's copy of them).
glibc serves such an allocation with a fresh `mmap` unless its dynamic threshold has
risen past that size, and hands a freed top of the heap back to the kernel once it
exceeds the trim threshold (128 KiB at first). Either way the next message is written
into fresh pages, and faulting in 256 pages per MiB costs about as much as copying them. Setting both
thresholds keeps big blocks on the heap and the freed ones mapped (grpc backend on this
2-core machine: 1.2–1.6 → 2.0 GB/s from 64 MB up; bare grpc-python 1.5–1.9 → 2.8–3.3).
Setting only one of them turns glibc's dynamic adjustment off and makes things slower
than the defaults, so `keep_freed_heap` always sets both.

The cost is resident memory: up to `keep_bytes` of freed heap stays with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
DEFAULT_KEEP_MIB = 256  # the transfer service's --heap-keep-mib


def keep_freed_heap(keep_bytes: int) -> bool:
    """Serve allocations up to 32 MiB from the heap and keep up to `keep_bytes` of freed heap
    mapped. Returns False (and changes nothing) where the C library has no glibc `mallopt`
    or refuses the values; `keep_bytes` 0 leaves the defaults and returns False too."""
    mallopt = _mallopt()
    if keep_bytes <= 0 or mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, keep_bytes))


@functools.cache
def _mallopt():
    name = ctypes.util.find_library("c")
    if name is None or "musl" in name:  # musl's mallopt is a stub that ignores everything
        return None
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
    return mallopt
