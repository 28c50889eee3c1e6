"""Settings of a process that trains or samples: its thread count, and whether the C
allocator keeps freed memory for reuse or returns it to the kernel.

A training step allocates and frees the same large tensors again and again: a chunk of
logits (512 tokens x 49,152 vocabulary in float32 is 100 MB), its probabilities and their
gradient, the LM head's weight gradient (113 MB for SmolLM2), the sampler's key/value cache.
glibc's malloc serves every allocation above its mmap threshold (at most 32 MB) with fresh
pages from the kernel and unmaps them on free, so every such tensor pays again for the kernel
to fault in and zero its pages, far below the memory's rate.

:func:`keep_freed_memory` turns that off for the process (``mallopt``: no mmap for
allocations, and no returning the heap's free top to the kernel below 2 GiB), so freed blocks
are reused: training and generation measured faster, at a somewhat higher peak RSS
(bench/log.md). It changes where memory comes from, never a result. C libraries other
than glibc are left alone.

Kept memory is not reused perfectly: a freed block serves a later request only where that
fits, and PyTorch's 64-byte-aligned requests do not fit a freed block of their own size, so
with long responses (tensors of hundreds of megabytes, in ever-changing sizes) the heap grows
to about twice what is live at once, and all of it stays resident.
:func:`return_freed_memory` is the other choice: every block of at least
:data:`OWN_PAGES_FROM` gets pages of its own, unmapped when it is freed, so the resident
memory follows what is live, and each such tensor pays for its fresh pages again (slower
where the kernel is slow to hand out pages).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
KEEP_FREE_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int)
GLIBC_MMAP_MAX = 65536  # glibc's default number of mapped blocks
OWN_PAGES_FROM = 2**20  # return_freed_memory: blocks this large are mapped (a 4,096-token
# micro-batch's hidden states are 9 MB in float32; the sampler's per-token tensors far less)
RETURN_TOP_BYTES = 64 * 2**20  # and the heap's free top beyond this goes back


def configure_process(threads: int | None, reuse_freed_memory: bool) -> None:
    """``threads`` for PyTorch (None: one per CPU) and :func:`keep_freed_memory` or, without
    ``reuse_freed_memory``, :func:`return_freed_memory`."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    if reuse_freed_memory:
        keep_freed_memory()
    else:
        return_freed_memory()


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of unmapping it; False where the C
    library is not glibc (nothing changes there)."""
    return _malloc_options(((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_FREE_BYTES)))


def return_freed_memory() -> bool:
    """Make glibc's malloc map every block of :data:`OWN_PAGES_FROM` or more on pages of its
    own and unmap them when freed, and give the heap's free pages back now; False where the
    C library is not glibc (nothing changes there)."""
    # a fixed threshold also stops glibc from raising it to the size of each freed block
    applied = _malloc_options(((M_MMAP_MAX, GLIBC_MMAP_MAX), (M_MMAP_THRESHOLD, OWN_PAGES_FROM),
                               (M_TRIM_THRESHOLD, RETURN_TOP_BYTES)))
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim(0)
    return applied


class _MallocInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def free_heap_bytes() -> int:
    """Bytes glibc's malloc holds free in its heaps (``mallinfo2().fordblks``): memory this
    process already has that a new allocation may reuse (0 where that is unknown)."""
    info = _glibc_function("mallinfo2")
    if info is None:
        return 0
    info.restype = _MallocInfo
    return int(info().fordblks)


def _malloc_options(settings: tuple[tuple[int, int], ...]) -> bool:
    """glibc's ``mallopt(option, value)`` for each of ``settings``, in order, until one is
    refused; whether all were taken (False where the C library is not glibc)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) for option, value in settings)


def _glibc_function(name: str):
    """``name`` from the process's C library when that is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others
        return None
    return getattr(libc, name, None)
