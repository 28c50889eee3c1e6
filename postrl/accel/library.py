"""The one shared library of postrl's native kernels, built on first use
(:mod:`postrl.accel.build`), and the one table of its C functions.

Every kernel binds here, with its argument types; :class:`postrl.accel.native.NativeKernels`
(the sampler's), :mod:`postrl.accel.fused` and :mod:`postrl.accel.vocab` (the training
forward's element-wise work) and :mod:`postrl.accel.tiles` (bf16 products on AMX tiles) call
them through :func:`library`. It is None, and the backend keeps PyTorch's and oneDNN's
kernels, where the CPU has neither AVX-512F nor AVX2 with FMA, no compiler is found or the
build fails, loading it would bring a second OpenMP runtime next to PyTorch's, or
``POSTRL_NATIVE_KERNELS=0``; :func:`unavailable_reason` says which.
"""

from __future__ import annotations

import ctypes
import functools
import os

from postrl.accel.build import NativeUnavailable, build, openmp_runtimes

SWITCH = "POSTRL_NATIVE_KERNELS"  # "0": never use them
_P, _N, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# name: argument types (every function returns nothing unless RETURNS says otherwise)
SIGNATURES = {
    # gemm.c: float32 linears on packed panels
    "postrl_pack": (_P, _P, _N, _N),
    "postrl_linear": (_P, _N, _N, _P, _P, _N, _P, _I),
    # decode.c: a decode step's work between the linears (a dtype flag before the threads)
    "postrl_rms_norm": (_P, _P, _P, _N, _N, _F, _I, _I),
    "postrl_add_rms_norm": (_P, _P, _P, _P, _N, _N, _F, _I, _I),
    "postrl_silu_mul": (_P, _P, _N, _N, _I, _I),
    "postrl_rotate_store": (_P, _N, _P, _P, _P, _P, _P, *[_N] * 6, _I, _I),
    "postrl_attend_rows": (_P, _N, _P, _P, _N, _N, _P, _N, _P, *[_N] * 5, _F, _I, _I),
    # step.c: a decode step's layers in one call
    "postrl_decode_layers": (_N, *[_P] * 8, _F, _P, _P, *[_N] * 5, _P, _N, _F, _P, _P, _I,
                             _I),
    "postrl_decode_scratch": (_P,),
    # sample.c: an untruncated draw by inversion
    "postrl_sample": (_P, _N, _N, _N, _F, _P, _P, _P, _P, _I),
    # dpbf16.c and amx_gemm.c: the sampler's bf16 linears
    "postrl_bf16_linears": (),
    "postrl_bf16_pack": (_P, _P, _N, _N, _I),
    "postrl_bf16_linear": (_P, _N, _N, _P, _P, _N, _P, _I),
    "postrl_dpbf16_linear": (_P, _N, _N, _P, _P, _N, _P, _I),
    # amx_gemm.c and amx_attention.c: the update's bf16 products on AMX tiles
    "postrl_amx_transpose": (_P, _N, _N, _N, _P, _N, _I),
    "postrl_amx_gemm": (_P, _N, _N, _N, _P, _P, _N, _N, _P, _N, _P, _N, _I, _I),
    "postrl_amx_gemm_sum": (_I, *[_P] * 6, _N, _P, _P, _N, _P, _N, _I, _I),
    "postrl_amx_attention_forward": (*[_P] * 6, *[_N] * 6, _F, _I),
    "postrl_amx_attention_backward": (*[_P] * 8, *[_N] * 6, _F, _I),
    # fused.c: the training forward's element-wise work, forward and backward
    "postrl_norm_forward": (_P, _P, _P, _P, _N, _N, _F, _I, _I),
    "postrl_norm_backward": (_P, _P, _P, _P, _P, _P, _N, _N, _I, _I),
    "postrl_swiglu_forward": (_P, _N, _P, _N, _P, _N, _N, _I, _I),
    "postrl_swiglu_backward": (_P, _P, _N, _P, _N, _P, _P, _N, _N, _I, _I),
    "postrl_softmax_forward": (_P, _P, _P, _N, _N, _N, _N, _F, _I, _I),
    "postrl_softmax_backward": (_P, _P, _P, _N, _N, _F, _I, _I),
    "postrl_rotate": (_P, _N, _N, _N, _P, _P, _P, _N, _N, _N, _N, _I, _I, _I),
    "postrl_add_bf16": (_P, _P, _N, _I),
    # vocab.c: the vocabulary's log-probability and entropy
    "postrl_logprob_forward": (_P, _N, _N, _N, _P, _F, _P, _P, _P, _I, _I),
    "postrl_logprob_backward": (_P, _N, _N, _N, _P, _F, _P, _P, _P, _P, _P, _I, _I),
}
RETURNS = {"postrl_decode_scratch": _N, "postrl_bf16_linears": _I}
OPTIONAL = {"postrl_dpbf16_linear"}  # built only for a CPU with AVX512-BF16


class Library:
    """The loaded library: each function of :data:`SIGNATURES` as an attribute, without its
    ``postrl_`` prefix (None for a missing one of :data:`OPTIONAL`); ``amx``: AMX tiles serve
    here (built for, and granted by Linux);
    ``bf16_linears``: the sampler's bf16 linears do (AMX, or AVX512-BF16's VDPBF16PS)."""

    def __init__(self, handle: ctypes.CDLL) -> None:
        self.handle = handle
        for name, argtypes in SIGNATURES.items():
            function = getattr(handle, name, None) if name in OPTIONAL else getattr(handle, name)
            if function is None:
                setattr(self, name.removeprefix("postrl_"), None)
                continue
            function.argtypes, function.restype = list(argtypes), RETURNS.get(name)
            setattr(self, name.removeprefix("postrl_"), function)
        kind = self.bf16_linears()  # 2: AMX tiles; 1: VDPBF16PS only; 0: neither
        self.amx, self.bf16_linears = kind == 2, kind > 0


def library() -> Library | None:
    """The native kernels, built and loaded on first call; None where they are not used."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why :func:`library` returns None (None when it does not)."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    return _load()[1]


@functools.cache
def _load() -> tuple[Library | None, str | None]:
    try:
        path = build()
        runtimes = openmp_runtimes()
        handle = ctypes.CDLL(str(path))
        added = openmp_runtimes() - runtimes
        if runtimes and added:
            return None, f"{path.name} loads another OpenMP runtime ({sorted(added)})"
        return Library(handle), None
    except NativeUnavailable as error:
        return None, str(error)
    except OSError as error:
        return None, f"cannot build or load the native kernels: {error}"
