"""A benchmark's child processes: a memory limit each, and why one that ran out failed."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# how an allocation past the child's memory limit ends (PyTorch's allocator, Python, the kernel)
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "Cannot allocate memory",
                 "std::bad_alloc")


def default_memory_limit_gb() -> float:
    """90% of this machine's memory: the rest for the parent, the OS and the page cache."""
    return round(0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def memory_limit(gigabytes: float):
    """A child's ``preexec_fn``: at most ``gigabytes`` of data (heap and anonymous mappings,
    RLIMIT_DATA), so a framework that needs more fails with an allocation error instead of
    the kernel killing whichever process it picks."""
    limit = int(gigabytes * 2**30)
    return lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def out_of_memory(stderr: str, limit_gb: float) -> str | None:
    """Why a child failed, if it ran out of memory: the limit, the allocation that failed and
    the framework's innermost frame that asked for it (so a reader sees which phase)."""
    if not any(sign in stderr for sign in OUT_OF_MEMORY):
        return None
    why = f"out of memory: needs more than {limit_gb:.1f} GB"
    size = re.search(r"tried to allocate (\d+) bytes", stderr)
    if size:
        why += f"; {int(size[1]) / 1e9:.2f} GB more failed"
    frames = re.findall(r'File "[^"]*/((?:trl|transformers|postrl)/[^"]+)", line \d+, in (\w+)',
                        stderr)
    if frames:
        why += f" in {frames[-1][1]} ({frames[-1][0]})"
    return why


def run_child(argv: list[str], limit_gb: float, what: str) -> dict:
    """The ``RESULT {json}`` line of ``python -m argv[0] argv[1:]`` (a module of ``bench``)
    run under :func:`memory_limit`; ``{"failed": why}`` if it ran out of memory; SystemExit
    naming ``what`` with the child's stderr if it failed otherwise."""
    # the repository's root on the child's path: it imports bench wherever this process runs
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                         preexec_fn=memory_limit(limit_gb), env={**os.environ, "PYTHONPATH": path})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    why = out_of_memory(out.stderr, limit_gb) if out.returncode else None
    if why:
        return {"failed": why}
    if out.returncode or not lines:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])
