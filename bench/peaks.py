"""This machine's measured limits: the fastest matmul per dtype and the memory-read rate."""

from __future__ import annotations

import os
import time
from functools import partial

import torch


def fastest(call, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls, after one warm-up call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 3072),
                repeats: int = 10) -> float:
    """GFLOP/s of the fastest square matmul, over ``sizes`` and ``repeats`` calls of each (a
    peak: the best seen; one size at 5 calls read 20% low on a noisy run)."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        best = max(best, 2 * size**3 / fastest(partial(torch.matmul, a, b), repeats) / 1e9)
    return best


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s of the fastest sum over a ``megabytes`` buffer (far larger than the caches)."""
    source = torch.ones(megabytes * 2**20 // 4)
    return source.numel() * 4 / fastest(source.sum, repeats) / 1e9


def machine_limits(settings: list[str]) -> tuple[dict[str, float], float]:
    """This machine's matmul peak per setting (``fp32``, ``bf16``; GFLOP/s) and memory-read
    rate (GB/s), measured with every core and printed."""
    torch.set_num_threads(os.cpu_count() or 1)
    peaks = {s: matmul_peak(torch.float32 if s == "fp32" else torch.bfloat16) for s in settings}
    bandwidth = read_bandwidth()
    print(", ".join(f"matmul peak {s}: {v:.0f} GFLOP/s" for s, v in peaks.items())
          + f", memory read: {bandwidth:.1f} GB/s", flush=True)
    return peaks, bandwidth
