"""postrl's own float32 linear for the lean sampler (``gemm.c``), compiled on first use.

At a decode step's 1 to 32 rows, oneDNN's packed float32 linear leaves about a fifth of the
time it takes on the table: measured on an AVX-512 CPU (2 cores, SmolLM2's 121 linears of one
decode step, the weights streamed from memory), ``gemm.c`` takes 0.78-0.85× its time at 2 to
32 rows (docs/performance.md, "postrl's own float32 linear").

The C source ships with the package and is compiled once per source, compiler and CPU with the
system's C compiler (``$CC``, else ``cc``) into ``native/`` in postrl's cache
(``$POSTRL_CACHE``, default ``~/.cache/postrl``). It is not used, and the sampler keeps
oneDNN's linear, when the CPU has no AVX-512F, no compiler is found or the build fails,
loading it would bring a second OpenMP runtime next to PyTorch's, or
``POSTRL_NATIVE_LINEAR=0``; :func:`unavailable_reason` says which.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from postrl.models.loading import cache_dir as postrl_cache

SOURCE = Path(__file__).with_name("gemm.c")
SWITCH = "POSTRL_NATIVE_LINEAR"  # "0": never use it
PANEL = 32  # output columns per packed panel (gemm.c's NR)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class NativeUnavailable(RuntimeError):
    """Why the native linear cannot be used here."""


class NativeLinear:
    """The loaded library: :meth:`pack` a weight once, then multiply by it."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._pack = library.postrl_pack
        self._pack.argtypes = [pointer, pointer, size, size]
        self._pack.restype = None
        self._linear = library.postrl_linear
        self._linear.argtypes = [pointer, size, size, pointer, pointer, size, pointer,
                                 ctypes.c_int]
        self._linear.restype = None

    def pack(self, weights: list[Tensor]) -> Tensor:
        """The row-concatenation of ``weights`` (each ``[out, in]``) as float32 panels of 32
        output columns, zero-padded; a single contiguous float32 weight is read in place."""
        weight = (weights[0] if len(weights) == 1 else torch.cat(weights)).detach()
        weight = weight.to(torch.float32).contiguous()
        out_features, in_features = weight.shape
        panels = -(-out_features // PANEL)
        packed = torch.empty(panels * PANEL * in_features, dtype=torch.float32)
        self._pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    @staticmethod
    def pad_bias(bias: Tensor | None) -> Tensor | None:
        """``bias`` zero-padded to the packed panels' width (None stays None)."""
        if bias is None:
            return None
        padded = torch.zeros(-(-len(bias) // PANEL) * PANEL, dtype=torch.float32)
        padded[: len(bias)] = bias.detach()
        return padded

    def __call__(self, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int,
                 out: Tensor | None = None) -> Tensor:
        """``x [..., in] W^T + bias`` for a packed ``W``, float32, ``[..., out_features]``;
        written into ``out`` (contiguous, ``[rows, out_features]``) when given."""
        leading, in_features = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, in_features).contiguous()
        shape = (rows.shape[0], out_features)
        if rows.dtype != torch.float32 or packed.numel() % in_features:
            raise ValueError(f"native linear: float32 rows of {packed.numel()} / panel "
                             f"width inputs expected, got {rows.dtype} rows of {in_features}")
        if out is None:
            out = torch.empty(shape, dtype=torch.float32)
        elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"native linear: out must be a contiguous float32 {shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        self._linear(rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(),
                     None if bias is None else bias.data_ptr(), out_features, out.data_ptr(),
                     torch.get_num_threads())
        return out.view(*leading, out_features)


def native_linear() -> NativeLinear | None:
    """The native linear, built and loaded on first call; None where it is not used."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    library, _ = _load()
    return library


def unavailable_reason() -> str | None:
    """Why :func:`native_linear` returns None (None when it does not)."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    return _load()[1]


@functools.cache
def _load() -> tuple[NativeLinear | None, str | None]:
    try:
        path = _build()
        runtimes = _openmp_runtimes()
        library = ctypes.CDLL(str(path))
        added = _openmp_runtimes() - runtimes
        if runtimes and added:
            return None, f"{path.name} loads another OpenMP runtime ({sorted(added)})"
        return NativeLinear(library), None
    except NativeUnavailable as error:
        return None, str(error)
    except OSError as error:
        return None, f"cannot build or load {SOURCE.name}: {error}"


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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> Path:
    """The library for this source, compiler and CPU, compiled now unless already cached."""
    compiler = _compiler()
    if not compiler:
        raise NativeUnavailable("no C compiler: neither $CC, cc nor gcc")
    key = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(), _cpu().encode()]
    )).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"linear-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        built = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", str(partial)],
                               capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeUnavailable(f"{compiler} could not build {SOURCE.name}: {error}") from error
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no message"])[-1]
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"{compiler} could not build {SOURCE.name}: {last}")
    os.replace(partial, target)  # atomic: a concurrent process sees all of it or nothing
    return target


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {path for path in paths if Path(path).name.startswith(names)}
