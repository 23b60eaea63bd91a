"""How the process holds its host memory: freed blocks kept, embedding tables on huge pages.

glibc serves large blocks (a CPU step's activations are many MB each) with mmap and unmaps
them on free, so every step page-faults its working set back in. Measured on 2 cores,
configs/bench_cpu.yaml in bf16: 68 ms/step before, 55 ms/step with `keep_freed_memory`.

An embedding lookup reads rows scattered over the whole table: with 4 KiB pages nearly every
row costs a TLB miss too. `use_huge_pages` moves a table onto 2 MiB pages in place (Linux
transparent huge pages). On the same model's tables (benchmarks/cpu_lookup.py): lookup 6.9 ->
6.3 ms, SGD update 4.6 -> 4.1 ms a step; collapsing its 666 MB of tables takes 1.5 s, once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's malloc.h
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # madvise advice, Linux's mman.h
HUGE_PAGE = 2 << 20


@lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and never trim it; False where libc is not glibc."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def use_huge_pages(tensor: torch.Tensor) -> bool:
    """Back the whole 2 MiB pages inside `tensor`'s memory with huge pages, now (MADV_COLLAPSE,
    Linux 6.1+) or as the kernel gets to it; False where the system has no say in it."""
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return False
    madvise(start, end - start, MADV_COLLAPSE)  # older kernels refuse it: khugepaged does it later
    return True
