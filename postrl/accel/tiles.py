"""The update's bf16 linear gradients on AMX tiles (``amx_gemm.c``).

For a linear ``y = x W^T`` the backward multiplies twice: the input gradient ``dy W`` and the
weight gradient ``dy^T x``. oneDNN ran both well below this CPU's bf16 rate at the update's
shapes (docs/performance.md). Here each thread packs the panels of the second operand it owns
into tiles (the weight, or ``x``; ``dy`` is transposed first for the weight gradient) and
multiplies. Under ``precision=bf16-master`` the weight gradient is added in float32 straight
into the float32 master's gradient (:func:`master_of`), where PyTorch's path writes it in bf16
and a hook then adds that into the master's: one rounding and one pass fewer. The down
projection's ``dy W`` (a weight wider than it is tall) measured slower here and stays with
oneDNN.

Linears that read the same input (a layer's query, key and value projections; its gate and
up projections) share one backward (:func:`linears`): their input gradient is one product
over their outputs side by side, ``[dy_q dy_k dy_v] [W_q; W_k; W_v]``, summed in float32 in
the tiles and rounded once, where autograd would add three bf16 products in two more passes.

Where this does not serve (no AMX, other dtypes or devices, tensor subclasses, a
``torch.compile`` trace, inner dimensions not a multiple of 32) PyTorch's matmuls run.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from postrl.accel.library import Library, library
from postrl.accel.native import amx_packed_size
from postrl.models.precision import master_of

BLOCK = 32  # amx_gemm.c's tiles take the inner dimension 32 at a time (native.AMX_INPUTS)
SLICE = 2048  # dy W's inner dimension in slices beyond this (the LM head's): timed best
_BF16, _FLOAT, _FLOAT_ADD = 0, 1, 2  # amx_gemm.c's output modes


class _Tiles:
    """``amx_gemm.c``'s packing, transposition and product in the loaded native library; and its
    training attention (``attention_forward``, ``attention_backward``:
    ``postrl.accel.tile_attention``)."""

    def __init__(self, library: Library) -> None:
        self.attention_forward = library.amx_attention_forward
        self.attention_backward = library.amx_attention_backward
        self._transpose, self._gemm = library.amx_transpose, library.amx_gemm
        self._gemm_sum = library.amx_gemm_sum

    def product(self, a: Tensor, b: Tensor, out: Tensor, mode: int) -> Tensor:
        """``out [m, n]`` := (or, ``_FLOAT_ADD``, +=) ``a [m, k] b [kb, n]`` (``b``'s rows
        past ``kb`` up to ``k`` taken as zeros; rows of each contiguous). Each thread first
        packs the panels of ``b`` it multiplies by into tiles (``packed``: their scratch)."""
        (m, k), (kb, n) = a.shape, b.shape
        packed = torch.empty(amx_packed_size(n, k), dtype=torch.bfloat16)
        self._gemm(a.data_ptr(), a.stride(0), m, k, packed.data_ptr(), b.data_ptr(), kb,
                   b.stride(0), None, n, out.data_ptr(), out.stride(0), mode,
                   torch.get_num_threads())
        return out

    def input_grad(self, grad: Tensor, weight: Tensor) -> Tensor:
        """``grad [m, out] W`` for ``W [out, in]``, in bf16. Beyond ``SLICE`` outputs (the LM
        head's vocabulary) the product goes in slices of them, summed in float32."""
        rows, (outputs, inputs) = grad.shape[0], weight.shape
        if outputs <= SLICE:
            return self.input_grads([(grad, weight)])
        total = torch.empty(rows, inputs, dtype=torch.float32)
        for start in range(0, outputs, SLICE):
            self.product(grad[:, start:start + SLICE], weight[start:start + SLICE], total,
                         _FLOAT if start == 0 else _FLOAT_ADD)
        return total.bfloat16()

    def input_grads(self, pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
        """``sum_i grad_i W_i`` in bf16 (``grad_i [m, out_i]``, ``W_i [out_i, in]``, each
        ``out_i`` a multiple of 32): one product over the ``out_i`` side by side, summed in
        float32 in the tiles and rounded once."""
        count, (rows, inputs) = len(pairs), (pairs[0][0].shape[0], pairs[0][1].shape[1])
        pointers, sizes = ctypes.c_void_p * count, ctypes.c_int64 * count
        outputs = sizes(*(w.shape[0] for _, w in pairs))
        packed = torch.empty(amx_packed_size(inputs, sum(outputs)), dtype=torch.bfloat16)
        out = torch.empty(rows, inputs, dtype=torch.bfloat16)
        self._gemm_sum(count, pointers(*(g.data_ptr() for g, _ in pairs)),
                       sizes(*(g.stride(0) for g, _ in pairs)), outputs,
                       pointers(*(w.data_ptr() for _, w in pairs)), outputs,
                       sizes(*(w.stride(0) for _, w in pairs)), rows, packed.data_ptr(), None,
                       inputs, out.data_ptr(), out.stride(0), _BF16, torch.get_num_threads())
        return out

    def add_weight_grad(self, total: Tensor | None, grad: Tensor, x: Tensor) -> Tensor:
        """``total + grad^T x`` in float32 (``total`` float32 ``[out, in]``, updated in place;
        None: the product alone) for ``grad [m, out]`` and ``x [m, in]``."""
        rows, outputs = grad.shape
        padded = -(-rows // BLOCK) * BLOCK
        transposed = torch.empty(outputs, padded, dtype=torch.bfloat16)
        self._transpose(grad.data_ptr(), rows, outputs, grad.stride(0), transposed.data_ptr(),
                        padded, torch.get_num_threads())
        if type(total) is Tensor and total.dtype == torch.float32 and total.is_contiguous():
            return self.product(transposed, x, total, _FLOAT_ADD)
        alone = self.product(transposed, x, torch.empty(outputs, x.shape[1],
                                                        dtype=torch.float32), _FLOAT)
        return alone if total is None else total.add_(alone)


@functools.cache
def _tiles(library: Library) -> _Tiles:
    return _Tiles(library)


def kernels(*tensors: Tensor) -> _Tiles | None:
    """The tiles' bindings when they serve these tensors: plain bf16 CPU tensors whose rows are
    contiguous, on a CPU with AMX, outside a compile trace; else None."""
    if torch.compiler.is_compiling() or any(
            type(t) not in (Tensor, torch.nn.Parameter) or t.device.type != "cpu"
            or t.dtype != torch.bfloat16 or t.dim() != 2 or t.stride(1) != 1
            or t.shape[0] == 0 for t in tensors):
        return None
    loaded = library()
    return _tiles(loaded) if loaded is not None and loaded.amx else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, its backward by :func:`linear_backward` where
    :func:`serves` says the tiles would take it (else ``F.linear`` itself)."""
    if serves(x, weight):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None],
            outputs: list[Tensor] | None = None) -> list[Tensor]:
    """``[F.linear(x, W_i, b_i)]`` for linears that read the same ``x`` (a layer's query, key
    and value projections; its gate and up projections), where :func:`serves_together` says
    so; with ``outputs``, their values already known (``postrl.accel.recorded``). Their
    backward sums the input gradients ``sum_i dy_i W_i`` in float32 on the tiles and rounds
    once; apart, autograd adds the bf16 products, one add (a pass over the micro-batch) per
    extra linear, each rounding to bf16 again."""
    known = [None] * len(weights) if outputs is None else outputs
    return list(_Linears.apply(x, len(weights), *weights, *biases, *known))


def serves_together(x: Tensor, weights: list[Tensor]) -> bool:
    """Whether :func:`linears` takes these: the tiles serve ``x`` and each weight (bf16 on
    AMX, a gradient to compute), and every weight's outputs, the products' inner dimension,
    are a multiple of 32."""
    return (serves(x, weights[0]) and kernels(*weights) is not None
            and all(w.shape[0] % BLOCK == 0 for w in weights))


class _Linears(torch.autograd.Function):
    """:func:`linears`: ``x`` and the linears' count, then their weights, biases and known
    outputs (None: multiply)."""

    @staticmethod
    def forward(ctx, x: Tensor, count: int, *tensors: Tensor | None) -> tuple[Tensor, ...]:
        weights, biases, known = (tensors[i * count:(i + 1) * count] for i in range(3))
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) if o is None else o.view_as(o)
                     for w, b, o in zip(weights, biases, known, strict=True))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, *weights = ctx.saved_tensors
        count, needs = len(weights), ctx.needs_input_grad
        rows = x.reshape(-1, x.shape[-1])
        flats = [g.reshape(-1, g.shape[-1]) for g in grads]
        dx = None
        if needs[0]:
            tiles = kernels(rows, *flats, *weights)
            dx = (tiles.input_grads(list(zip(flats, weights, strict=True))) if tiles is not None
                  else sum(g @ w for g, w in zip(flats, weights, strict=True)))
            dx = dx.view(x.shape)
        dweights = [linear_backward(g, rows, w, False, need)[1]
                    for g, w, need in zip(flats, weights, needs[2:2 + count], strict=True)]
        dbiases = [g.sum(dim=0) if need else None
                   for g, need in zip(flats, needs[2 + count:2 + 2 * count], strict=True)]
        return (dx, None, *dweights, *dbiases, *[None] * count)


def serves(x: Tensor, weight: Tensor) -> bool:
    """Whether a linear of ``x`` by ``weight`` would have its backward on the tiles: both bf16
    CPU tensors, a gradient to compute, AMX here."""
    return (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and type(x) is Tensor and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and kernels(weight) is not None)


class _Linear(torch.autograd.Function):
    """``x W^T + b`` by ``F.linear``, differentiated by :func:`backward`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return backward(grad, *ctx.saved_tensors, ctx.needs_input_grad)


def backward(grad: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, ...]
             ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``x W^T + b`` (``x [..., in]``) with respect to ``x``, ``W`` and
    ``b`` given ``grad [..., out]``, each None where ``needs`` (three flags) says not needed
    (``W``'s also where it went into its master's: :func:`linear_backward`)."""
    flat = grad.reshape(-1, grad.shape[-1])
    dx, dw = linear_backward(flat, x.reshape(-1, x.shape[-1]), weight, needs[0], needs[1])
    return (dx.view(*grad.shape[:-1], weight.shape[1]) if dx is not None else None, dw,
            flat.sum(dim=0) if needs[2] else None)


def linear_backward(grad: Tensor, x: Tensor, weight: Tensor, needs_x: bool,
                    needs_weight: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(dy W, dy^T x)`` of ``y = x W^T`` for ``grad`` and ``x`` as rows (2-d), each None where
    not needed. Where ``weight`` has a float32 master (``bf16-master``), its gradient is added
    into the master's ``.grad`` here and returned as None. PyTorch's matmuls where the tiles
    do not serve."""
    tiles = kernels(grad, x, weight)
    master = master_of(weight) if needs_weight else None
    dx = dw = None
    if needs_x:
        dx = input_grad(grad, weight, tiles)
    if needs_weight:
        if tiles is not None and master is not None:
            master.grad = tiles.add_weight_grad(master.grad, grad, x)
        else:
            dw = grad.t() @ x
    return dx, dw


def input_grad(grad: Tensor, weight: Tensor, tiles: _Tiles | None = None) -> Tensor:
    """``grad W`` (``grad [..., out]``, ``W [out, in]``): on the tiles where they serve and
    take this weight's shape (``tiles``: :func:`kernels`' answer, when already asked)."""
    rows = grad.reshape(-1, grad.shape[-1])
    tiles = tiles or kernels(rows, weight)
    if tiles is None or not _tiles_dx(*weight.shape):
        return grad @ weight
    return tiles.input_grad(rows, weight).view(*grad.shape[:-1], weight.shape[1])


def _tiles_dx(outputs: int, inputs: int) -> bool:
    """Whether the tiles take ``dy W`` for a weight ``[outputs, inputs]``: the product's inner
    dimension is ``outputs``, a multiple of 32; and not for a weight wider than it is tall
    (SmolLM2's down projection, 576 x 1,536, where oneDNN measured faster)."""
    return outputs % BLOCK == 0 and outputs >= inputs
