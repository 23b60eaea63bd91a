"""Keep freed host memory in the process instead of handing it back to the OS.

glibc serves large blocks (a CPU step's activations are many MB each) with mmap and unmaps
them on free, so every step page-faults its working set back in. Measured on 2 cores,
configs/bench_cpu.yaml in bf16: 68 ms/step before, 55 ms/step with this.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's malloc.h


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and never trim it; False where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
