"""The lean sampler's native kernels (:class:`NativeKernels`), on the one library of
:mod:`postrl.accel.library`; what each bought is in docs/performance.md.

- ``gemm.c``: float32 linear layers on weights packed once per ``generate``, at a decode
  step's few rows, where oneDNN's packed linear leaves time on the table;
- ``amx_gemm.c`` and ``dpbf16.c``: the same in bf16, on AMX tiles or by VDPBF16PS;
- ``decode.c``: a decode step's work between the linears (rotary embedding with the cache
  write, residual add with RMSNorm, SiLU(gate) * up, attention over each row's columns), one
  call per layer each instead of PyTorch's several small operations;
- ``step.c``: a decode step's layers in one call, the same kernels in the same order as the
  lean sampler's layer loop, without its Python in between;
- ``sample.c``: an untruncated draw by inversion with its log-probability and entropy, in
  three reading passes per row.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.accel.library import Library, library, unavailable_reason  # noqa: F401

PANEL = 32  # output columns per packed panel (gemm.c's NR)
AMX_INPUTS = 32  # amx_gemm.c's tiles take the inputs 32 at a time


class NativeKernels:
    """The loaded library: :meth:`pack` a weight once, then :meth:`linear` multiplies by it
    (float32); where ``bf16_linears``, :meth:`bf16_pack` and :meth:`bf16_linear` the same in
    bf16 (on AMX tiles, or by VDPBF16PS); ``amx``: whether AMX tiles serve here;
    :meth:`rms_norm`, :meth:`add_rms_norm`, :meth:`silu_mul`, :meth:`rotate_store`,
    :meth:`attend_rows` (float32 or bf16), :meth:`sample`; :meth:`decode_layers` runs a
    decode step's layers (float32, or bf16 with the bf16 linears). CPU tensors."""

    def __init__(self, library: Library) -> None:
        self.library = library
        self.amx, self.bf16_linears = library.amx, library.bf16_linears

    def pack(self, weights: list[Tensor]) -> Tensor:
        """The row-concatenation of ``weights`` (each ``[out, in]``) as float32 panels of 32
        output columns, zero-padded; a single contiguous float32 weight is read in place."""
        weight = _joined(weights, torch.float32)
        out_features, in_features = weight.shape
        panels = -(-out_features // PANEL)
        packed = torch.empty(panels * PANEL * in_features, dtype=torch.float32)
        self.library.pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    @staticmethod
    def pad_bias(bias: Tensor | None) -> Tensor | None:
        """``bias`` zero-padded to the packed panels' width (None stays None)."""
        if bias is None:
            return None
        padded = torch.zeros(-(-len(bias) // PANEL) * PANEL, dtype=torch.float32)
        padded[: len(bias)] = bias.detach()
        return padded

    def linear(self, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int,
               out: Tensor | None = None) -> Tensor:
        """``x [..., in] W^T + bias`` for a packed ``W``, float32, ``[..., out_features]``;
        written into ``out`` (contiguous, ``[rows, out_features]``) when given."""
        leading, in_features = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, in_features).contiguous()
        shape = (rows.shape[0], out_features)
        if rows.dtype != torch.float32 or packed.numel() % in_features:
            raise ValueError(f"native linear: float32 rows of {packed.numel()} / panel "
                             f"width inputs expected, got {rows.dtype} rows of {in_features}")
        out = _output(out, shape, torch.float32, "linear")
        self.library.linear(rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(),
                            None if bias is None else bias.data_ptr(), out_features, out.data_ptr(),
                            torch.get_num_threads())
        return out.view(*leading, out_features)

    def bf16_pack(self, weights: list[Tensor]) -> Tensor:
        """The row-concatenation of ``weights`` (each ``[out, in]``, ``in`` a multiple of 32)
        in bf16 as ``amx_gemm.c``'s tiles: panels of 16 outputs (zero-padded), 32 inputs a tile."""
        weight = _joined(weights, torch.bfloat16)
        out_features, in_features = weight.shape
        if not self.bf16_linears or in_features % AMX_INPUTS:
            raise ValueError(f"native bf16_pack: AMX or AVX512-BF16, and inputs of a multiple "
                             f"of {AMX_INPUTS} needed, got {in_features} (bf16 linears "
                             f"{'on' if self.bf16_linears else 'off'} here)")
        packed = torch.empty(amx_packed_size(out_features, in_features),
                             dtype=torch.bfloat16)
        self.library.bf16_pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features,
                       torch.get_num_threads())
        return packed

    def bf16_linear(self, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int,
                    out: Tensor | None = None) -> Tensor:
        """``x [..., in] W^T + bias`` in bf16 for a ``W`` packed by :meth:`bf16_pack`,
        ``[..., out_features]``; written into ``out`` (contiguous, ``[rows, out_features]``)
        when given."""
        leading, in_features = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, in_features).contiguous()
        shape = (rows.shape[0], out_features)
        if (rows.dtype != torch.bfloat16 or in_features % AMX_INPUTS
                or packed.numel() != amx_packed_size(out_features, in_features)
                or (bias is not None and (bias.dtype != torch.bfloat16
                                          or bias.shape != (out_features,)
                                          or not bias.is_contiguous()))):
            raise ValueError(f"native bf16_linear: bf16 rows of a packed [{out_features}, "
                             f"{in_features}] weight expected, got {rows.dtype} rows of "
                             f"{in_features}")
        out = _output(out, shape, torch.bfloat16, "bf16_linear")
        if rows.shape[0]:
            self.library.bf16_linear(rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(),
                             None if bias is None else bias.data_ptr(),
                             out_features, out.data_ptr(), torch.get_num_threads())
        return out.view(*leading, out_features)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
        x = x.contiguous()
        if (not _same_dtype(x, weight) or weight.shape != x.shape[-1:]
                or not weight.is_contiguous()):
            raise ValueError(f"native rms_norm: float32 or bf16 rows of {tuple(weight.shape)} "
                             f"{weight.dtype} expected, got {x.dtype} {tuple(x.shape)}")
        out = torch.empty_like(x)
        self.library.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              x.numel() // max(x.shape[-1], 1), x.shape[-1], eps, _bf16(x),
                              torch.get_num_threads())
        return out

    def add_rms_norm(self, hidden: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``hidden += delta`` in place (the residual stream), then :meth:`rms_norm` of it."""
        if not (_same_dtype(hidden, delta, weight)
                and hidden.shape == delta.shape and hidden.is_contiguous()
                and delta.is_contiguous() and weight.shape == hidden.shape[-1:]
                and weight.is_contiguous()):
            raise ValueError(f"native add_rms_norm: contiguous float32 or bf16 rows of "
                             f"{tuple(weight.shape)} expected, got hidden {hidden.dtype} "
                             f"{tuple(hidden.shape)}, delta {delta.dtype} {tuple(delta.shape)}")
        out = torch.empty_like(hidden)
        self.library.add_rms_norm(hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), hidden.numel() // max(hidden.shape[-1], 1),
                                  hidden.shape[-1], eps, _bf16(hidden), torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """``SiLU(gate) * up`` of ``gate_up [..., 2 * width]`` (gate first), ``[..., width]``."""
        gate_up = gate_up.contiguous()
        if not _same_dtype(gate_up) or gate_up.shape[-1] % 2:
            raise ValueError(f"native silu_mul: float32 or bf16 rows of gate and up expected, "
                             f"got {gate_up.dtype} {tuple(gate_up.shape)}")
        width = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype)
        self.library.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // max(width, 1),
                              width, _bf16(gate_up), torch.get_num_threads())
        return out

    def rotate_store(self, qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                     heads: int) -> Tensor:
        """A decode step's new column: ``qkv [rows, (heads + 2 kv_heads) * dim]`` (each row's
        query, key and value heads) rotated at ``cos``/``sin`` (``[rows, dim]``), the keys
        and the values written into ``keys``/``values`` (``[rows, kv_heads, dim]``: the KV
        cache's column, unit stride within a head); the rotated queries, ``[rows, heads,
        dim]``."""
        rows, kv_heads, dim = keys.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        if not (_same_dtype(qkv, cos, sin, keys, values)
                and qkv.shape == (rows, (heads + 2 * kv_heads) * dim)
                and qkv.stride(1) == 1 and cos.shape == sin.shape == (rows, dim)
                and keys.shape == values.shape and keys.stride() == values.stride()
                and keys.stride(2) == 1):
            raise ValueError(f"native rotate_store: float32 or bf16 decode-step layouts "
                             f"expected, got qkv {qkv.dtype} {tuple(qkv.shape)} {qkv.stride()}, "
                             f"cos {cos.dtype} {tuple(cos.shape)}, keys {keys.dtype} "
                             f"{tuple(keys.shape)} {keys.stride()}, {heads} query heads")
        queries = torch.empty((rows, heads, dim), dtype=qkv.dtype)
        self.library.rotate_store(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                  queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                  keys.stride(0), keys.stride(1), rows, heads, kv_heads, dim,
                                  _bf16(qkv), torch.get_num_threads())
        return queries

    def attend_rows(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Each row's queries ``q [rows, kv_heads, group, dim]`` over its own columns
        ``keys``/``values [rows, kv_heads, columns, dim]`` under the additive ``mask [rows, 1,
        1, columns]``, scaled by ``dim ** -0.5``: ``[rows, kv_heads, group, dim]``. The layouts
        are a decode step's: views of the KV cache and of the rotated projections (unit
        strides within a head and between a group's heads)."""
        rows, kv_heads, group, dim = q.shape
        columns = keys.shape[2]
        if not (_same_dtype(q, keys, values, mask)
                and q.stride()[1:] == (group * dim, dim, 1)
                and keys.stride() == values.stride() and keys.stride()[2:] == (dim, 1)
                and keys.shape == values.shape == (rows, kv_heads, columns, dim)
                and mask.shape == (rows, 1, 1, columns) and mask.stride(-1) == 1):
            raise ValueError("native attend_rows: float32 or bf16 decode-step layouts "
                             f"expected, got q {q.dtype} {tuple(q.shape)} {q.stride()}, keys "
                             f"{keys.dtype} {tuple(keys.shape)} {keys.stride()}, mask "
                             f"{mask.dtype} {tuple(mask.shape)} {mask.stride()}")
        out = torch.empty((rows, kv_heads, group, dim), dtype=q.dtype)
        self.library.attend_rows(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(),
                                 keys.stride(0), keys.stride(1), mask.data_ptr(), mask.stride(0),
                                 out.data_ptr(), rows, kv_heads, group, dim, columns, dim ** -0.5,
                                 _bf16(q), torch.get_num_threads())
        return out

    def decode_layers(self, layers: LayerPointers, hidden: Tensor, cos: Tensor, sin: Tensor,
                      keys: Tensor, values: Tensor, column: int, mask: Tensor,
                      outputs: list[int] | None) -> Tensor:
        """A decode step's decoder layers, one call: ``hidden [rows, width]`` (the residual
        stream, added to in place) through every layer of ``layers``, the new keys and values
        written into column ``column`` of ``keys``/``values`` (``[layers, rows, kv_heads,
        columns, dim]``, attended up to that column under ``mask [rows, columns]``), each
        linear's output into ``outputs`` (its address per layer and kind, ``[rows, width]``
        each: a record's slots) when given; the stream after the final norm, ``[rows,
        width]``. The same kernels in the same order as the lean sampler's layer loop; every
        tensor in ``layers``' dtype (float32, or bf16 with ``dpbf16.c``'s linears)."""
        rows, width = hidden.shape
        dim = keys.shape[-1]
        columns = column + 1
        if not (_same_dtype(hidden, keys, values, mask, cos, sin)
                and hidden.dtype == layers.dtype and hidden.is_contiguous()
                and width == layers.width and keys.shape == values.shape
                and keys.stride() == values.stride() and keys.shape[:2] == (layers.count, rows)
                and keys.shape[2:] == (layers.kv_heads, keys.shape[3], layers.head_dim)
                and keys.stride()[3:] == (dim, 1) and columns <= keys.shape[3]
                and cos.shape == sin.shape == (rows, dim) and cos.is_contiguous()
                and sin.is_contiguous() and mask.shape[0] == rows
                and mask.shape[1] >= columns and mask.stride(1) == 1
                and (outputs is None or len(outputs) == len(layers.weights))):
            raise ValueError(f"native decode_layers: {layers.dtype} decode-step layouts "
                             f"expected, got hidden {hidden.dtype} {tuple(hidden.shape)}, "
                             f"keys {keys.dtype} {tuple(keys.shape)} "
                             f"{keys.stride()}, cos {tuple(cos.shape)}, mask "
                             f"{tuple(mask.shape)}, column {column}")
        sizes = (ctypes.c_int64 * 6)(rows, width, layers.heads, layers.kv_heads, dim,
                                     layers.inner)
        scratch = torch.empty(self.library.decode_scratch(sizes), dtype=hidden.dtype)
        normed = torch.empty_like(hidden)
        record = None if outputs is None else (ctypes.c_void_p * len(outputs))(*outputs)
        self.library.decode_layers(layers.count, sizes, hidden.data_ptr(), normed.data_ptr(),
                                   cos.data_ptr(), sin.data_ptr(), layers.weights, layers.biases,
                                   layers.norms, layers.eps, keys.data_ptr(), values.data_ptr(),
                                   keys.stride(0), keys.stride(1), keys.stride(2), column, columns,
                                   mask.data_ptr(), mask.stride(0), dim ** -0.5, record,
                                   scratch.data_ptr(), _bf16(hidden), torch.get_num_threads())
        return normed

    def sample(self, logits: Tensor, temperature: float, draws: Tensor, with_entropy: bool
               ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(tokens, logprobs, entropies or None)``, one each per row of ``logits [rows,
        vocab]``: with ``z = logits / temperature`` and ``p = softmax(z)``, the first token
        whose cumulative ``p`` exceeds the row's uniform ``draws [rows]`` (float64), ``log p``
        of it, and the entropy of ``p`` (``with_entropy``). ``postrl.rollout.sampling``'s
        untruncated draw, up to float rounding."""
        rows, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        draws = draws.to(torch.float64).contiguous()
        if (logits.dtype != torch.float32 or not temperature > 0 or vocab < 1
                or draws.shape != (rows,)):
            raise ValueError(f"native sample: float32 logits [rows, vocab], one float64 draw "
                             f"per row and a positive temperature expected, got "
                             f"{logits.dtype} {tuple(logits.shape)}, draws "
                             f"{tuple(draws.shape)}, temperature {temperature}")
        tokens = torch.empty(rows, dtype=torch.long)
        logprobs = torch.empty(rows, dtype=torch.float32)
        entropies = torch.empty(rows, dtype=torch.float32) if with_entropy else None
        self.library.sample(logits.data_ptr(), rows, vocab, logits.stride(0), temperature,
                            draws.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
                            None if entropies is None else entropies.data_ptr(),
                            torch.get_num_threads())
        return tokens, logprobs, entropies


def _joined(weights: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The row-concatenation of ``weights`` in ``dtype``, contiguous (a single contiguous
    weight already in ``dtype`` is not copied)."""
    weight = (weights[0] if len(weights) == 1 else torch.cat(weights)).detach()
    return weight.to(dtype).contiguous()


def _output(out: Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
            name: str) -> Tensor:
    """A linear's output: ``out`` if it is a contiguous ``dtype`` tensor of ``shape`` (else
    an error naming the kernel ``name``), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        dtype_name = "bf16" if dtype == torch.bfloat16 else "float32"
        raise ValueError(f"native {name}: out must be a contiguous {dtype_name} {shape}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


def amx_packed_size(out_features: int, in_features: int) -> int:
    """Values in ``amx_gemm.c``'s packing of a ``[out_features, in_features]`` weight (or of a
    ``[in_features, out_features]`` operand packed by the product itself): panels of 16
    outputs, the last zero-padded, ``in_features`` a multiple of 32."""
    return -(-out_features // 16) * 16 * in_features


def _same_dtype(*tensors: Tensor) -> bool:
    """All float32, or all bf16 (``decode.c``'s kernels take one dtype per call)."""
    return (tensors[0].dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == tensors[0].dtype for t in tensors))


def _bf16(tensor: Tensor) -> int:
    """``decode.c``'s dtype flag for ``tensor``."""
    return int(tensor.dtype == torch.bfloat16)


@dataclass
class LayerPointers:
    """A model's packed weights as :meth:`NativeKernels.decode_layers` reads them: per layer
    its four linears' packed weights and biases (``postrl/accel/csrc/step.c``'s order: q|k|v,
    output, gate|up, down) and its two norms, then the final norm; float32 (``gemm.c``'s
    panels, padded biases) or bf16 (``amx_gemm.c``'s tiles). Holds the tensors, so the addresses
    stay valid while it lives."""

    tensors: list[Tensor | None]
    weights: ctypes.Array
    biases: ctypes.Array
    norms: ctypes.Array
    count: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    eps: float
    dtype: torch.dtype  # the norms', and so the layers' and their activations'

    @classmethod
    def of(cls, linears: list[list[tuple[Tensor, Tensor | None]]], norms: list[Tensor],
           heads: int, kv_heads: int, head_dim: int, inner: int, eps: float
           ) -> LayerPointers:
        """``linears``: per layer, ``(packed weight, its bias or None)`` of each of its four
        linears; ``norms``: each layer's input and post-attention norm weights, then the
        final norm's (contiguous, all float32 or all bf16)."""
        pairs = [pair for layer in linears for pair in layer]
        if any(len(layer) != 4 for layer in linears) or len(norms) != 2 * len(linears) + 1:
            raise ValueError("native decode layers: four linears and two norms per layer, "
                             "and a final norm, expected")
        if not _same_dtype(*norms) or any(not n.is_contiguous() for n in norms):
            raise ValueError("native decode layers: contiguous norm weights, all float32 or "
                             "all bf16, expected")

        def addresses(tensors):
            return (ctypes.c_void_p * len(tensors))(
                *(None if t is None else t.data_ptr() for t in tensors))

        return cls([t for pair in pairs for t in pair] + list(norms),
                   addresses([w for w, _ in pairs]), addresses([b for _, b in pairs]),
                   addresses(norms), len(linears), norms[0].shape[0], heads, kv_heads,
                   head_dim, inner, eps, norms[0].dtype)


def native_kernels() -> NativeKernels | None:
    """The sampler's native kernels, built and loaded on first call; None where they are not
    used (:func:`unavailable_reason` says why)."""
    loaded = library()
    return None if loaded is None else _kernels(loaded)


@functools.cache
def _kernels(loaded: Library) -> NativeKernels:
    return NativeKernels(loaded)
