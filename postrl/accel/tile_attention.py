"""The training attention of a bf16 micro-batch on AMX tiles, forward and backward in one
kernel each (``amx_attention.c``: ``postrl_amx_attention_forward`` and ``_backward``).

PyTorch's path runs a layer's attention as two batched matmuls around a softmax (the
``bmm``s over ``[rows x kv_heads]`` matrices of a few dozen by a hundred), and its backward
as four more around the softmax's: each reads and writes the full ``[rows, heads, L, P + L]``
scores or their gradient in memory, and at SmolLM2's shapes they are bound by those reads and
writes. Here each thread takes whole (row, key/value head) items: the scores, their softmax
and their gradients stay in its cache, in float32; only the weights (bf16, kept for the
backward, as PyTorch's path keeps them) go to memory, and the output is written where the
output projection reads it (what it saves: bench/log.md, "The training attention and grouped
input gradients on AMX tiles"; docs/performance.md).

The maths is :func:`postrl.models.ops.attention`'s: ``softmax(scale * q k^T + bias)`` in
float32, rounded to bf16, times the values. The scores and their gradient stay float32 here
(PyTorch's path rounds both to bf16 between its kernels), so the result is as close or closer
to the exact one (``tests/accel/test_tile_attention.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.accel import tiles


def serves(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> bool:
    """Whether :func:`attention` takes ``query [B, heads, L, d]`` over ``keys`` and ``values
    [B, kv_heads, C, d]`` with ``bias [B, 1, L, C]``: bf16 CPU tensors on a CPU with AMX,
    ``d`` a multiple of 32, outside autocast (with or without a gradient to compute: scoring
    and training run the same maths)."""
    rows, heads, width, dim = query.shape
    columns = keys.shape[2]
    return (dim % tiles.BLOCK == 0 and heads % keys.shape[1] == 0 and min(rows, width) > 0
            and columns > 0 and keys.shape == values.shape == (rows, keys.shape[1], columns, dim)
            and bias.shape == (rows, 1, width, columns) and bias.dtype == torch.bfloat16
            and not torch.is_autocast_enabled("cpu")  # one [L or C, d] matrix of each
            and tiles.kernels(query[0, 0], keys[0, 0], values[0, 0]) is not None)


def attention(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float
              ) -> Tensor:
    """``[B, L, heads * d]``: ``softmax(scale * query keys^T + bias) values``, query head
    ``h`` over key/value head ``h // (heads / kv_heads)``, where :func:`serves` says so."""
    return _Attention.apply(query, keys, values, bias, scale)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, bias: Tensor,
                scale: float) -> Tensor:
        query, keys, values, bias = (t.contiguous() for t in (query, keys, values, bias))
        rows, heads, width, dim = query.shape
        kv_heads, columns = keys.shape[1], keys.shape[2]
        weights = torch.empty(rows, heads, width, columns, dtype=torch.bfloat16)
        out = torch.empty(rows, width, heads * dim, dtype=torch.bfloat16)
        ctx.tiles = tiles.kernels(query[0, 0])  # the bindings serves() found
        ctx.tiles.attention_forward(query.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                    bias.data_ptr(), weights.data_ptr(), out.data_ptr(),
                                    rows, heads, kv_heads, width, columns, dim, scale,
                                    torch.get_num_threads())
        ctx.save_for_backward(query, keys, values, weights)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, keys, values, weights = ctx.saved_tensors
        rows, heads, width, dim = query.shape
        kv_heads, columns = keys.shape[1], keys.shape[2]
        grad = grad.to(torch.bfloat16).contiguous()
        dquery, dkeys, dvalues = (torch.empty_like(t) for t in (query, keys, values))
        ctx.tiles.attention_backward(grad.data_ptr(), query.data_ptr(), keys.data_ptr(),
                                     values.data_ptr(), weights.data_ptr(), dquery.data_ptr(),
                                     dkeys.data_ptr(), dvalues.data_ptr(), rows, heads,
                                     kv_heads, width, columns, dim, ctx.scale,
                                     torch.get_num_threads())
        return dquery, dkeys, dvalues, None, None
