"""The training forward's building blocks in PyTorch's operations: what every backend falls
back to (``postrl.models.backend``), and what runs when there is none.

Each matches transformers' Llama/Qwen2 modules in value and rounding: RMSNorm normalises in
float32 and rounds before the weight, SiLU rounds before its product, the attention softmax
runs in float32 at least.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# where SDPA always attends; on a CPU, plain matmul-softmax trained faster at short answers'
# lengths, and SDPA's flash kernel from about this many scores per row and head on (it never
# holds the [L, T] scores: at 1,024 new tokens they are most of a micro-batch's activations)
FUSED_ATTENTION_DEVICES = ("cuda",)
FUSED_ATTENTION_SCORES = 2**16


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm of ``x`` over its last dimension: normalised in float32, rounded
    to ``x``'s dtype, then multiplied by ``weight``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``SiLU(gate) * up``, SiLU's output rounded to the dtype before the product."""
    return F.silu(gate) * up


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (last dimension: the head's, in two halves) at the
    angles whose cosines and sines are ``cos``/``sin`` (broadcast against ``x``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float,
              softmax: Callable[[Tensor, Tensor, float], Tensor] | None = None) -> Tensor:
    """``[B, L, heads * d]``: ``query [B, heads, L, d]`` over ``keys`` and ``values [B,
    kv_heads, T, d]`` under the additive ``bias [B, 1, L, T]``, the scores times ``scale``;
    query head ``h`` reads key/value head ``h // group``. SDPA on the devices of
    :data:`FUSED_ATTENTION_DEVICES` and from :data:`FUSED_ATTENTION_SCORES` scores (``L x T``)
    on; else two matmuls around a float32 softmax, with the scale on the queries (the smaller
    tensor) unless ``softmax(scores, bias, scale)`` (a backend's fused, scaled and biased
    softmax over ``[B, heads, L, T]``) is given."""
    rows, heads, width, dim = query.shape
    kv_heads, columns = keys.shape[1], keys.shape[2]
    if (query.device.type in FUSED_ATTENTION_DEVICES
            or width * columns >= FUSED_ATTENTION_SCORES):
        return sdpa_attention(query, keys, values, bias, scale)
    group = heads // kv_heads
    scores = torch.matmul((query if softmax else query * scale).reshape(
        rows, kv_heads, group * width, dim), keys.transpose(2, 3))
    if softmax:
        weights = softmax(scores.view(rows, heads, width, columns), bias, scale)
    else:
        scores = (scores.view(rows, kv_heads, group, width, columns) + bias[:, :, None]).view(
            rows, kv_heads, group * width, columns)
        # float32 at least (float64 stays float64: its masked -1.8e308 would become -inf)
        softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
        weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    out = torch.matmul(weights.view(rows, kv_heads, group * width, columns), values)
    return out.view(rows, heads, width, dim).transpose(1, 2).reshape(rows, width, heads * dim)


def sdpa_attention(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor,
                   scale: float) -> Tensor:
    """:func:`attention` by PyTorch's fused attention (SDPA: flash-style kernels on a GPU,
    which never hold the ``[L, T]`` scores). The bias in the queries' dtype: masked columns at
    that dtype's lowest finite value, so a row with none allowed (left padding) stays
    finite."""
    rows, heads, width, dim = query.shape
    mask = bias.to(query.dtype).clamp(min=torch.finfo(query.dtype).min)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != heads)
    return out.transpose(1, 2).reshape(rows, width, heads * dim)
