"""The training forward's element-wise work as single kernels, forward and backward
(``fused.c``): RMSNorm, ``SiLU(gate) * up``, the rotary embedding, the attention's scaled and
biased softmax, and a bf16 gradient's accumulation into its float32 master.

PyTorch runs transformers' RMSNorm as about eight operations forward and a dozen backward, and
``SiLU(gate) * up`` as two forward and four backward, each a pass over the micro-batch (in bf16
with a conversion on either side). Here each is one pass per row, forward and backward, with
the forward's roundings (the backward computes in float32 and rounds once, where PyTorch's
bf16 autograd rounds its intermediate products too). They serve float32 and bf16 CPU tensors;
anything else (another device or dtype, a tensor subclass such as FSDP's DTensor, a
``torch.compile`` trace, a CPU without the native kernels) takes PyTorch's operations
(:mod:`postrl.models.ops`), which compute the same maths. What each bought:
bench/log.md ("The training forward's element-wise work in C"), docs/performance.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.accel.library import Library, library
from postrl.models import ops

_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm of ``x`` over its last dimension: normalised in float32, rounded
    to ``x``'s dtype, then multiplied by ``weight``."""
    if native(x, weight) is not None:
        return _RMSNorm.apply(x, weight, eps)
    return ops.rms_norm(x, weight, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``SiLU(gate) * up``, SiLU's output rounded to the dtype before the product."""
    if native(gate, up) is not None and gate.shape == up.shape:
        return _SwiGLU.apply(gate, up)
    return ops.swiglu(gate, up)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (last dimension: the head's, in two halves) at the
    angles whose cosines and sines are ``cos``/``sin`` (broadcast against ``x``). One kernel
    for ``x [B, heads, L, d]`` (each head's row contiguous) and angles ``[B, 1, L, d]``."""
    if _rotates(x, cos, sin):
        return _Rotate.apply(x, cos.contiguous(), sin.contiguous())
    return ops.rotate(x, cos, sin)


def _rotates(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the kernel serves :func:`rotate`'s arguments (angles without a gradient)."""
    if x.dim() != 4:
        return False
    rows, _, width, dim = x.shape
    return (cos.shape == sin.shape == (rows, 1, width, dim) and dim % 2 == 0
            and x.stride(-1) == 1 and not (cos.requires_grad or sin.requires_grad)
            and native(x, cos, sin) is not None)


def add_into(into: Tensor, grad: Tensor) -> None:
    """``into += grad`` in place: a bf16 gradient into its float32 master gradient in one pass
    where the kernels serve them (both contiguous CPU tensors of as many values)."""
    bindings = (native(grad) if into.dtype == torch.float32 and grad.dtype == torch.bfloat16
                and into.numel() == grad.numel() and into.is_contiguous()
                and grad.is_contiguous() and native(into) is not None else None)
    if bindings is None:
        into.add_(grad)
    else:
        bindings.add_bf16(into.data_ptr(), grad.data_ptr(), into.numel(), torch.get_num_threads())


def fuses_attention(query: Tensor, bias: Tensor, columns: int) -> bool:
    """Whether :func:`attention_weights` serves the scores of ``query [B, heads, L, d]`` over
    ``columns`` keys with ``bias``."""
    rows, _, width, _ = query.shape
    # under autocast the scores' matmul runs in bf16 whatever the queries' dtype
    return (native(query, bias) is not None and bias.shape == (rows, 1, width, columns)
            and not torch.is_autocast_enabled(query.device.type))


def attention_weights(scores: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale * scores + bias)`` over the last dimension, in float32, rounded to
    ``scores``' dtype: ``scores [B, heads, L, C]``, ``bias [B, 1, L, C]`` (additive, the same
    for every head), where :func:`fuses_attention` says so."""
    return _Softmax.apply(scores.contiguous(), bias.contiguous(), scale)


def native(*tensors: Tensor) -> Library | None:
    """The kernels' bindings when they serve these tensors (plain CPU tensors of one dtype,
    float32 or bf16, outside a compile trace), else None."""
    first = tensors[0]
    if (first.dtype not in _DTYPES or torch.compiler.is_compiling()
            or any(type(t) not in (Tensor, torch.nn.Parameter) or t.device.type != "cpu"
                   or t.dtype != first.dtype for t in tensors)):
        return None
    return library()


def _rows(t: Tensor) -> Tensor:
    """``t`` as contiguous rows of its last dimension."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _strided_rows(t: Tensor) -> tuple[Tensor, int]:
    """``t`` as rows of its last dimension, each contiguous, and the rows' stride (no copy where
    ``t`` is already such: the gate and up halves of a recorded gate|up output)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        bindings, rows = native(x, weight), _rows(x)
        weight_c = weight.detach().contiguous()
        y = torch.empty_like(rows)
        scale = torch.empty(rows.shape[0], dtype=torch.float32)
        bindings.norm_forward(rows.data_ptr(), weight_c.data_ptr(), y.data_ptr(),
                              scale.data_ptr(), rows.shape[0], rows.shape[1], eps,
                              int(x.dtype == torch.bfloat16), torch.get_num_threads())
        ctx.save_for_backward(rows, weight_c, scale)
        ctx.shape, ctx.bindings = x.shape, bindings
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight, scale = ctx.saved_tensors
        bindings, threads = ctx.bindings, torch.get_num_threads()
        grad = _rows(grad.to(rows.dtype))
        dx = torch.empty_like(rows)
        partial = (torch.zeros(threads, rows.shape[1], dtype=torch.float32)
                   if ctx.needs_input_grad[1] else None)
        bindings.norm_backward(grad.data_ptr(), rows.data_ptr(), weight.data_ptr(),
                               scale.data_ptr(), dx.data_ptr(),
                               None if partial is None else partial.data_ptr(), rows.shape[0],
                               rows.shape[1], int(rows.dtype == torch.bfloat16), threads)
        dweight = None if partial is None else partial.sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dweight, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        bindings = native(gate, up)
        (gate_rows, gate_stride), (up_rows, up_stride) = _strided_rows(gate), _strided_rows(up)
        h = torch.empty(gate_rows.shape, dtype=gate.dtype)
        bindings.swiglu_forward(gate_rows.data_ptr(), gate_stride, up_rows.data_ptr(), up_stride,
                                h.data_ptr(), h.shape[0], h.shape[1],
                                int(gate.dtype == torch.bfloat16), torch.get_num_threads())
        ctx.save_for_backward(gate_rows, up_rows)
        ctx.strides, ctx.shape, ctx.bindings = (gate_stride, up_stride), gate.shape, bindings
        return h.view(gate.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        bindings, (gate_stride, up_stride) = ctx.bindings, ctx.strides
        grad = _rows(grad.to(gate.dtype))
        dgate, dup = torch.empty_like(grad), torch.empty_like(grad)
        bindings.swiglu_backward(grad.data_ptr(), gate.data_ptr(), gate_stride, up.data_ptr(),
                                 up_stride, dgate.data_ptr(), dup.data_ptr(), grad.shape[0],
                                 grad.shape[1], int(gate.dtype == torch.bfloat16),
                                 torch.get_num_threads())
        return dgate.view(ctx.shape), dup.view(ctx.shape)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, bias: Tensor, scale: float) -> Tensor:
        rows, heads, width, columns = scores.shape
        out = torch.empty_like(scores)
        ctx.bindings = native(scores, bias)
        ctx.bindings.softmax_forward(
            scores.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, heads, width, columns,
            scale, int(scores.dtype == torch.bfloat16), torch.get_num_threads())
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weights,) = ctx.saved_tensors
        grad = grad.to(weights.dtype).contiguous()
        dscores = torch.empty_like(weights)
        ctx.bindings.softmax_backward(
            weights.data_ptr(), grad.data_ptr(), dscores.data_ptr(),
            weights.numel() // max(weights.shape[-1], 1), weights.shape[-1], ctx.scale,
            int(weights.dtype == torch.bfloat16), torch.get_num_threads())
        return dscores, None, None


def _rotation(bindings: Library, x: Tensor, cos: Tensor, sin: Tensor,
              inverse: bool) -> Tensor:
    rows, heads, width, dim = x.shape
    out = torch.empty((rows, heads, width, dim), dtype=x.dtype)
    bindings.rotate(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(),
                    sin.data_ptr(), out.data_ptr(), rows, heads, width, dim, int(inverse),
                    int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.bindings = native(x, cos)
        return _rotation(ctx.bindings, x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad.to(cos.dtype)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotation(ctx.bindings, grad, cos, sin, inverse=True), None, None
