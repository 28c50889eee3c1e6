"""Compiling postrl's C kernels (``postrl.accel.library`` loads and binds them).

The sources ship with the package and are compiled into one library with the system's C
compiler (``$CC``, else ``cc``, else ``gcc``) and ``-march=native``, once per sources,
flags, compiler and CPU, into ``native/`` in postrl's cache (``$POSTRL_CACHE``, default
``~/.cache/postrl``); a library built for another CPU is never loaded here.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from postrl.models.loading import cache_dir as postrl_cache

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # included by the sources
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class NativeUnavailable(RuntimeError):
    """Why the native kernels cannot be used here."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``native/`` in postrl's cache (``$POSTRL_CACHE``, else
    ``~/.cache/postrl``)."""
    return postrl_cache() / "native"


def _cpu() -> str:
    """This CPU's model and features: a library built with ``-march=native`` runs only there."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc``, else ``gcc`` (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build() -> Path:
    """The library for these sources, compiler and CPU, compiled now unless already cached."""
    cc = compiler()
    if not cc:
        raise NativeUnavailable("no C compiler: neither $CC, cc nor gcc")
    key = hashlib.sha256(b"\0".join(
        [*(file.read_bytes() for file in SOURCES + HEADERS), " ".join(FLAGS).encode(),
         cc.encode(), _cpu().encode()]
    )).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    names = " and ".join(source.name for source in SOURCES)
    try:
        built = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(partial), "-lm"],
                               capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeUnavailable(f"{cc} could not build {names}: {error}") from error
    if built.returncode != 0:
        lines = built.stderr.strip().splitlines() or ["no message"]
        errors = [line for line in lines if "error" in line]
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"{cc} could not build {names}: {(errors or lines)[0]}")
    os.replace(partial, target)  # atomic: a concurrent process sees all of it or nothing
    return target


def openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {path for path in paths if Path(path).name.startswith(names)}
