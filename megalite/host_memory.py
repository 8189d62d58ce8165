"""Host memory kept in the process once freed, as a caching allocator keeps device memory.

glibc's malloc returns freed memory at the top of its heap to the kernel once more than a
trim threshold is free there (by default twice the size of the largest block it has freed
from an mmap, so a few MB in a small model), and the next step's allocations fault every page
of it back in, zero-filled. A training step frees and reallocates the same activations every
step, so a CPU run pays those page faults each step: on the nanoGPT baby model 500-3,000 a
step, varying with the heap's layout from run to run, up to a tenth of the step
(docs/benchmarks.md). PyTorch's CUDA allocator caches device memory for the same reason;
its CPU allocator calls malloc and free. Intel's guide for PyTorch on CPUs preloads jemalloc
or tcmalloc; megalite sets glibc itself: blocks below 32 MB (glibc's largest mmap threshold)
come from the heap, and the heap is not trimmed, so the high-water mark of a step is reused by
the next one. Blocks of 32 MB and more are still mapped and unmapped each time.
"""

import ctypes
import os

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20
"""glibc's largest accepted mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""
NEVER_TRIM = 2**31 - 1
"""The largest trim threshold (mallopt takes a C int): the heap is never trimmed."""
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory() -> bool:
    """Set glibc's malloc as the module docstring says; whether it did. Not where the user
    set malloc's thresholds in the environment (glibc read them at start: they stay), nor
    where the C library is not glibc (no mallopt: macOS, musl)."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # Setting either threshold freezes the other's dynamic adjustment: set both.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM))
