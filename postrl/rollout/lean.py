"""A lean sampling forward for Llama-style models: packed weights and a preallocated KV cache.

Sampling is bound by reading the weights once per new token. transformers' generic forward
adds, at every token, a ``torch.cat`` of the whole KV cache in every layer (quadratic in the
length), a copy of keys and values repeated over each group's query heads (eager attention)
and seven separately dispatched matmuls per layer whose weights oneDNN reorders at every call.
Here, once per ``generate`` call, the projections are fused (q|k|v, gate|up), cast to the
sampling dtype and reordered into oneDNN's blocked layout; the cache is allocated once for the
whole response (``[layers, rows, kv_heads, prompt + max_new, head_dim]``), each token writes
one column, and attention is PyTorch's fused kernel (``scaled_dot_product_attention``), whose
query heads of a group read their shared key/value head without a repeated copy.

The arithmetic is the model's own (RMSNorm in float32, the model's rotary module with its
float32 frequencies, the attention softmax in float32); :func:`unsupported_reason` names what
it does not cover, and such models are sampled with transformers' forward instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from postrl.models.layers import architecture_reason


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot sample from ``model`` (None when it can)."""
    reason = architecture_reason(model)
    if reason is None and any(p.device.type != "cpu" for p in model.parameters()):
        return "weights not on the CPU"
    return reason


class Linear:
    """``x W^T + b`` with ``W`` (the row-concatenation of ``weights``) cast to ``dtype`` and, where
    oneDNN is available, reordered once into its blocked layout for ``rows``-row inputs."""

    def __init__(self, weights: list[Tensor], biases: list[Tensor | None], dtype: torch.dtype,
                 rows: int) -> None:
        weight = torch.cat([w.detach() for w in weights]).to(dtype)
        self.bias = (None if biases[0] is None
                     else torch.cat([b.detach() for b in biases]).to(dtype))
        self.packed = _packable(dtype)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, max(rows, 1))
                       if self.packed else weight)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _packable(dtype: torch.dtype) -> bool:
    """oneDNN is there and handles ``dtype`` on this CPU (bf16/fp16 need ISA support)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


@dataclass
class Layer:
    qkv: Linear
    out: Linear
    gate_up: Linear
    down: Linear
    input_norm: Tensor
    post_norm: Tensor


@dataclass
class LeanWeights:
    """One snapshot of a model's weights, ready for sampling (rebuild it after every update)."""

    embed: Tensor  # the model's own table, rows cast on lookup
    layers: list[Layer]
    norm: Tensor
    lm_head: Linear
    rotary: nn.Module
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    @torch.no_grad()
    def of(cls, model, dtype: torch.dtype, rows: int) -> LeanWeights:
        config, body = model.config, model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            layers.append(Layer(
                Linear([m.weight for m in qkv], [m.bias for m in qkv], dtype, rows),
                Linear([attn.o_proj.weight], [attn.o_proj.bias], dtype, rows),
                Linear([mlp.gate_proj.weight, mlp.up_proj.weight],
                       [mlp.gate_proj.bias, mlp.up_proj.bias], dtype, rows),
                Linear([mlp.down_proj.weight], [mlp.down_proj.bias], dtype, rows),
                layer.input_layernorm.weight.detach().to(dtype),
                layer.post_attention_layernorm.weight.detach().to(dtype)))
        return cls(body.embed_tokens.weight.detach(), layers, body.norm.weight.detach().to(dtype),
                   Linear([model.lm_head.weight], [None], dtype, rows), body.rotary_emb,
                   body.norm.variance_epsilon, heads, kv_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, dtype)


class KVCache:
    """Keys and values of every layer for ``capacity`` columns, filled left to right; ``mask``
    is additive over the columns (0 where a row attends, a large negative on its padding)."""

    def __init__(self, weights: LeanWeights, rows: int, capacity: int) -> None:
        shape = (len(weights.layers), rows, weights.kv_heads, capacity, weights.head_dim)
        self.keys = torch.empty(shape, dtype=weights.dtype)  # a column is read only once written
        self.values = torch.empty(shape, dtype=weights.dtype)
        self.mask = torch.zeros((rows, capacity), dtype=weights.dtype)
        self.length = 0

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) ``rows``; an index may repeat."""
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)
        self.mask = self.mask.index_select(0, rows)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The fused kernel: it reduces in float32 (bf16 input too) and rounds once, after the
    weight (transformers also rounds before the weight)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attend(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention of ``query [rows, S, heads, dim]`` over the cache's ``keys``/``values``
    ``[rows, kv_heads, T, dim]``; ``[rows, S, heads * dim]``. Query head ``h`` reads key/value
    head ``h // group``. PyTorch's fused kernel keeps the softmax and its weighted sum in
    float32.

    Decoding (``S == 1``), a group's query heads become the query positions of their shared
    key/value head (the mask has no causal part to tell them apart), so the kernel reads each
    cached key and value once instead of once per query head, as ``enable_gqa`` does.
    """
    rows, new, heads, dim = query.shape
    kv_heads = keys.shape[1]
    if new == 1:
        grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
        return out.reshape(rows, 1, heads * dim)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(rows, new, heads * dim)


@torch.inference_mode()
def forward(w: LeanWeights, cache: KVCache, tokens: Tensor, positions: Tensor,
            valid: Tensor) -> Tensor:
    """Feed ``tokens [rows, S]`` (at ``positions``; ``valid`` False on padding) into the next
    ``S`` columns of ``cache``; the logits ``[rows, vocab]`` after the last column."""
    rows, new = tokens.shape
    start, end = cache.length, cache.length + new
    floor = torch.finfo(w.dtype).min  # not -inf: a padding query that sees only padding is
    cache.mask[:, start:end] = torch.where(valid, 0.0, floor)  # harmless instead of NaN
    cache.length = end
    mask = cache.mask[:, None, None, :end]  # [rows, 1, 1, T]
    if new > 1:  # causal within the new columns
        future = torch.ones((new, end), dtype=torch.bool).triu(start + 1)
        mask = mask.masked_fill(future, floor)
    hidden = F.embedding(tokens, w.embed).to(w.dtype)
    cos, sin = (t[:, :, None] for t in w.rotary(hidden, positions))  # [rows, S, 1, head_dim]
    dim, heads = w.head_dim, w.heads + w.kv_heads  # heads: of queries and keys together
    for i, layer in enumerate(w.layers):
        qkv = layer.qkv(_rms_norm(hidden, layer.input_norm, w.eps))
        # queries and keys rotate together: they are the first columns of qkv
        rotated = _rotate(qkv[..., : heads * dim].view(rows, new, heads, dim), cos, sin)
        cache.keys[i, :, :, start:end] = rotated[:, :, w.heads:].transpose(1, 2)
        cache.values[i, :, :, start:end] = qkv[..., heads * dim:].view(
            rows, new, w.kv_heads, dim).transpose(1, 2)
        out = _attend(rotated[:, :, : w.heads], cache.keys[i, :, :, :end],
                      cache.values[i, :, :, :end], mask)
        hidden = hidden + layer.out(out)
        gate, up = layer.gate_up(_rms_norm(hidden, layer.post_norm, w.eps)).chunk(2, dim=-1)
        hidden = hidden + layer.down(F.silu(gate) * up)
    return w.lm_head(_rms_norm(hidden[:, -1], w.norm, w.eps))


class LeanDecoder:
    """The engine's decoder interface over :func:`forward`: prefill once, then one token per
    call; ``select`` keeps only the given rows."""

    def __init__(self, weights: LeanWeights, input_ids: Tensor, attention: Tensor,
                 positions: Tensor, group_size: int, max_new_tokens: int) -> None:
        self.weights = weights
        self.cache = KVCache(weights, input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
        self.first_logits = forward(weights, self.cache, input_ids, positions, attention.bool())
        # the G samples of a prompt share its prefill: repeat the cache, not the computation
        self.cache.select(torch.arange(input_ids.shape[0]).repeat_interleave(group_size))
        self.first_logits = self.first_logits.repeat_interleave(group_size, dim=0)

    def select(self, keep: Tensor) -> None:
        self.cache.select(keep)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        ones = torch.ones((len(tokens), 1), dtype=torch.bool)
        return forward(self.weights, self.cache, tokens[:, None], positions[:, None], ones)
