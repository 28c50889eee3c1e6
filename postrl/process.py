"""Settings of a process that trains or samples: its thread count, and whether the C
allocator keeps freed memory for reuse.

A training step allocates and frees the same large tensors again and again: a chunk of
logits (512 tokens x 49,152 vocabulary in float32 is 100 MB), its probabilities and their
gradient, the LM head's weight gradient (113 MB for SmolLM2), the sampler's key/value cache.
glibc's malloc serves every allocation above its mmap threshold (at most 32 MB) with fresh
pages from the kernel and unmaps them on free, so every such tensor pays again for the kernel
to fault in and zero its pages, far below the memory's rate.

:func:`keep_freed_memory` turns that off for the process (``mallopt``: no mmap for
allocations, and no returning the heap's free top to the kernel below 2 GiB), so freed blocks
are reused: training and generation measured faster, at a somewhat higher peak RSS
(docs/performance-log.md). It changes where memory comes from, never a result. C libraries other
than glibc are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
KEEP_FREE_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int)


def configure_process(threads: int | None, reuse_freed_memory: bool) -> None:
    """``threads`` for PyTorch (None: one per CPU) and, with ``reuse_freed_memory``,
    :func:`keep_freed_memory`."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    if reuse_freed_memory:
        keep_freed_memory()


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of unmapping it; False where the C
    library is not glibc (nothing changes there)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES))


def _glibc_function(name: str):
    """``name`` from the process's C library when that is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others
        return None
    return getattr(libc, name, None)
