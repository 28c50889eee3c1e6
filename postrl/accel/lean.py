"""A lean sampling forward for Llama-style models: packed weights and a preallocated KV cache.

Sampling is bound by reading the weights once per new token. transformers' generic forward
adds, at every token, a ``torch.cat`` of the whole KV cache in every layer (quadratic in the
length), a copy of keys and values repeated over each group's query heads (eager attention)
and seven separately dispatched matmuls per layer whose weights oneDNN reorders at every call.
Here, once per ``generate`` call (``postrl.accel.lean_weights``), the projections are fused
(q|k|v, gate|up), cast to the sampling dtype and reordered into oneDNN's blocked layout (on a
CPU with AVX-512 or AVX2, packed for postrl's own kernels instead, :mod:`postrl.accel.native`: in
float32, and in bf16 where the CPU has AMX tiles or AVX512-BF16; they run all of a step's
layers in one call once each row holds its own cache, and on such a CPU a step's work between
the linears is postrl's kernels in bf16 too); the cache is allocated once for the whole response,
each token writes one column, and attention (postrl's kernel, PyTorch's fused kernel, or two
batched matmuls around a softmax where those are faster) lets the query heads of a group read
their shared key/value head without a repeated copy. A prompt's keys and values are stored
once and read once for all its G samples (:class:`KVCache`, cascade attention:
:func:`_with_shared_prompts`), not copied G times.

The arithmetic is the model's own (RMSNorm in float32, the model's rotary module with its
float32 frequencies, the attention softmax in float32); :func:`unsupported_reason` names what
it does not cover, and such models are sampled with transformers' forward instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from postrl.accel.lean_weights import LeanWeights
from postrl.accel.native import NativeKernels
from postrl.accel.recorded import RecordedForward
from postrl.models.backend import Past
from postrl.models.layers import architecture_reason, rotate


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot sample from ``model`` (None when it can; LoRA layers are
    sampled through their merged weights)."""
    reason = architecture_reason(model, adapters=True)
    if reason is None and any(p.device.type != "cpu" for p in model.parameters()):
        return "weights not on the CPU"
    return reason


class KVCache:
    """Keys and values of every layer, written left to right, in one of two layouts.

    - **Shared**, while all the samples of every prompt are running: a prompt's columns are
      stored once (``prompt_keys``/``prompt_values``: ``[layers, prompts, kv_heads, P, dim]``;
      ``prompt_mask`` is additive over them: 0 where attended, a large negative on left
      padding) and read once for its ``width`` samples, rows ``p * width`` to
      ``(p + 1) * width - 1``; ``keys``/``values`` hold each row's response columns.
    - **Per row**, once finished rows have left (:meth:`select`): each row's ``keys``/``values``
      hold its prompt's columns, then its response's (``[layers, rows, kv_heads, P + max_new,
      dim]``), under ``row_mask``. The prompt copies cost a read per row, but no bookkeeping
      of which prompt the remaining rows sample from: a scatter of queries and a gather of
      outputs in every layer, which measured as slow or slower (bench/log.md).
    """

    def __init__(self, weights: LeanWeights, prompts: int, prompt_len: int, width: int,
                 max_new: int) -> None:
        layers, kv_heads, dim = len(weights.layers), weights.kv_heads, weights.head_dim
        shared = (layers, prompts, kv_heads, prompt_len, dim)
        # a column is read only once written
        self.prompt_keys = torch.empty(shared, dtype=weights.dtype)
        self.prompt_values = torch.empty(shared, dtype=weights.dtype)
        self.prompt_mask = torch.zeros((prompts, prompt_len), dtype=weights.dtype)
        own = (layers, prompts * width, kv_heads, max_new, dim)
        self.keys = torch.empty(own, dtype=weights.dtype)
        self.values = torch.empty(own, dtype=weights.dtype)
        self.row_mask: Tensor | None = None
        self.width, self.length = width, 0  # length: response columns written

    @property
    def shared(self) -> bool:
        return self.row_mask is None

    @property
    def offset(self) -> int:
        """Where the response columns start in ``keys``/``values``."""
        return 0 if self.shared else self.prompt_mask.shape[1]

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) ``rows``; the first call leaves the shared layout."""
        if self.shared:
            self._unshare(rows)
        else:
            self.keys = self.keys.index_select(1, rows)
            self.values = self.values.index_select(1, rows)
            self.row_mask = self.row_mask.index_select(0, rows)

    def _unshare(self, rows: Tensor) -> None:
        prompt, (layers, _, kv_heads, max_new, dim) = rows // self.width, self.keys.shape
        length = self.prompt_mask.shape[1]
        for name in ("keys", "values"):
            mine = torch.empty((layers, len(rows), kv_heads, length + max_new, dim),
                               dtype=self.keys.dtype)
            mine[:, :, :, :length] = getattr(self, f"prompt_{name}").index_select(1, prompt)
            mine[:, :, :, length:length + self.length] = (
                getattr(self, name)[:, :, :, :self.length].index_select(1, rows))
            setattr(self, name, mine)
        self.row_mask = torch.cat((self.prompt_mask.index_select(0, prompt),
                                   self.prompt_mask.new_zeros((len(rows), max_new))), dim=1)
        self.prompt_keys = self.prompt_values = None


def _rms_norm(x: Tensor, weight: Tensor, eps: float,
              native: NativeKernels | None = None) -> Tensor:
    """The fused kernel: it reduces in float32 (bf16 input too) and rounds once, after the
    weight (transformers also rounds before the weight); ``native``'s in one pass, if given."""
    if native is not None:
        return native.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def _add_rms_norm(hidden: Tensor, delta: Tensor, weight: Tensor, eps: float,
                  native: NativeKernels | None = None) -> Tensor:
    """``hidden += delta`` in place (the residual stream), then :func:`_rms_norm` of it;
    ``native``'s in one pass, if given."""
    if native is not None:
        return native.add_rms_norm(hidden, delta.view(hidden.shape), weight, eps)
    return _rms_norm(hidden.add_(delta), weight, eps)


def _silu_mul(gate_up: Tensor, native: NativeKernels | None = None) -> Tensor:
    """``SiLU(gate) * up``, ``gate_up`` their fused projection (gate first)."""
    if native is not None:
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _split_rotated(w: LeanWeights, qkv: Tensor, cos: Tensor, sin: Tensor):
    """Queries ``[rows, S, heads, dim]``, keys and values ``[rows, S, kv_heads, dim]`` from
    the fused projection ``qkv [rows, S, width]``, queries and keys rotated."""
    rows, new, _ = qkv.shape
    dim, heads = w.head_dim, w.heads + w.kv_heads  # heads: of queries and keys together
    # queries and keys rotate together: they are the first columns of qkv
    rotated = rotate(qkv[..., : heads * dim].view(rows, new, heads, dim), cos, sin)
    values = qkv[..., heads * dim:].view(rows, new, w.kv_heads, dim)
    return rotated[:, :, : w.heads], rotated[:, :, w.heads:], values


def _flash(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None):
    """PyTorch's fused CPU attention (softmax and weighted sum in float32), with the
    log-sum-exp of each query's scores: ``[B, H, L, dim]`` and ``[B, H, L]`` (float32)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, attn_mask=mask)


@functools.cache
def _flash_available() -> bool:
    """:func:`_flash`'s kernel is internal to PyTorch, so its presence (with a mask argument)
    is checked, not assumed; without it, prompts are not shared."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return op is not None and "attn_mask" in str(op.default._schema)


def _attend_decode(query: Tensor, cache: KVCache, layer: int,
                   native: NativeKernels | None = None) -> Tensor:
    """One new query per row (``[rows, heads, dim]``) over its prompt's columns and its own,
    ``[rows, heads * dim]``.

    Query head ``h`` reads key/value head ``h // group``: a group's query heads enter the
    kernel as query positions of their shared head (no causal mask tells them apart), so
    each cached key and value is read once, not once per query head as ``enable_gqa`` does.
    With ``native``, attention over each row's own columns is postrl's kernel.
    """
    rows, heads, dim = query.shape
    kv_heads = cache.keys.shape[2]
    q = query.view(rows, kv_heads, heads // kv_heads, dim)
    end = cache.offset + cache.length
    keys, values = cache.keys[layer, :, :, :end], cache.values[layer, :, :, :end]
    if not cache.shared:
        mask = cache.row_mask[:, None, None, :end]
        if native is not None:
            return native.attend_rows(q, keys, values, mask).reshape(rows, -1)
        return _attend_rows(q, keys, values, mask).reshape(rows, -1)
    own, own_lse = _flash(q, keys, values)
    return _with_shared_prompts(q, own, own_lse, cache, layer).reshape(rows, heads * dim)


# Running rows from which a float32 decode step's attention is two batched matmuls around a
# softmax rather than PyTorch's fused kernel, whose blocking is built for long query blocks:
# at many rows of a few queries each the matmuls measured faster, at a few rows their
# separate calls cost more (bench/log.md, "Decode attention as matmuls").
MATMUL_ATTENTION_FROM_ROWS = 16


def _attend_rows(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Each row's queries (``[rows, kv_heads, group, dim]``) over its own cached columns
    (``[rows, kv_heads, columns, dim]``) under its additive ``mask``: by matmuls in float32
    from :data:`MATMUL_ATTENTION_FROM_ROWS` rows, else by the fused kernel (whose softmax
    runs in float32 where bf16 matmuls would round the scores)."""
    if q.dtype != torch.float32 or q.shape[0] < MATMUL_ATTENTION_FROM_ROWS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def _with_shared_prompts(q: Tensor, own: Tensor, own_lse: Tensor, cache: KVCache,
                         layer: int) -> Tensor:
    """Attention over the prompts' shared columns, merged with ``own`` (each row's attention
    over its response columns, ``own_lse`` its log-sum-exps).

    Each prompt's columns are read once for its ``width`` rows, whose queries enter the
    kernel as one prompt's query positions; the two parts' softmaxes are then weighted by
    their shares of the whole from the two log-sum-exps (cascade attention over a shared
    prefix: Juravsky et al. 2024, "Hydragen"), which is the softmax over all the columns up
    to float rounding.
    """
    rows, kv_heads, group, dim = q.shape
    prompts, width = cache.prompt_mask.shape[0], cache.width
    queries = q.view(prompts, width, kv_heads, group, dim).transpose(1, 2)
    out, lse = _flash(queries.reshape(prompts, kv_heads, width * group, dim),
                      cache.prompt_keys[layer], cache.prompt_values[layer],
                      cache.prompt_mask[:, None, None, :])
    out = out.view(prompts, kv_heads, width, group, dim).transpose(1, 2)
    lse = lse.view(prompts, kv_heads, width, group).transpose(1, 2)
    share = torch.sigmoid(lse - own_lse.view(lse.shape))[..., None]  # the prompt's, float32
    return torch.lerp(own.view(out.shape), out, share.to(own.dtype))


def _attend_prompt(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Causal attention within the prompts: ``query [prompts, P, heads, dim]``, ``keys`` and
    ``values`` ``[prompts, P, kv_heads, dim]``; ``[prompts, P, heads * dim]``."""
    prompts, length, heads, dim = query.shape
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=heads != keys.shape[2])
    return out.transpose(1, 2).reshape(prompts, length, heads * dim)


def _layers(w: LeanWeights, tokens: Tensor, positions: Tensor, attend,
            into: Callable[[int, int], Tensor] | None = None,
            logits_into: Tensor | None = None) -> Tensor:
    """The decoder over ``tokens [rows, S]``; ``attend(layer, qkv, cos, sin)`` rotates the
    fused projection's queries and keys (``qkv [rows, S, width]``, ``cos``/``sin``
    ``[rows, S, 1, dim]``), stores the new keys and values and attends (``[rows, S, heads *
    dim]``); ``into(layer, kind)``, when given, is where each linear's output goes too
    (``[rows * S, width]``; ``postrl.accel.recorded.KINDS``), ``logits_into`` the logits'.
    The logits after the last column, ``[rows, vocab]``."""
    hidden = F.embedding(tokens, w.embed).to(w.dtype)  # a new tensor: added to in place
    cos, sin = (t[:, :, None] for t in w.rotary(hidden, positions))  # [rows, S, 1, head_dim]
    into = into or (lambda layer, kind: None)
    normed = _rms_norm(hidden, w.layers[0].input_norm, w.eps, w.native)
    for i, layer in enumerate(w.layers):
        attended = attend(i, layer.qkv(normed, into(i, 0)), cos, sin)
        normed = _add_rms_norm(hidden, layer.out(attended, into(i, 1)), layer.post_norm, w.eps,
                               w.native)
        act = _silu_mul(layer.gate_up(normed, into(i, 2)), w.native)
        following = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.norm
        normed = _add_rms_norm(hidden, layer.down(act, into(i, 3)), following, w.eps, w.native)
    return w.lm_head(normed[:, -1], logits_into)


def _slots(record: RecordedForward | None, slots: slice):
    """``_layers``' ``into``: ``record``'s ``slots`` (None without a record)."""
    if record is None:
        return None
    return lambda layer, kind: record.linears[layer][kind][slots]


@torch.inference_mode()
def prefill(w: LeanWeights, cache: KVCache, tokens: Tensor, positions: Tensor,
            valid: Tensor, record: RecordedForward | None = None, past: Past | None = None
            ) -> Tensor:
    """Feed the left-padded prompts ``tokens [prompts, P]`` (at ``positions``; ``valid``
    False on padding) into the cache's prompt columns after ``past``'s (if given; ``valid``
    covers them too); the logits after each prompt. With ``record``, the linears' outputs
    and those logits are written into its prompt slots."""
    floor = torch.finfo(w.dtype).min  # not -inf: a padding query that sees only padding is
    cache.prompt_mask.copy_(torch.where(valid, 0.0, floor))  # harmless instead of NaN
    length = tokens.shape[1]
    depth = valid.shape[1] - length  # the past's columns
    future = torch.ones((length, depth + length), dtype=torch.bool).triu(1 + depth)
    mask = cache.prompt_mask[:, None, None, :].masked_fill(future, floor)
    if past is not None:
        cache.prompt_keys[:, :, :, :depth] = past.keys
        cache.prompt_values[:, :, :, :depth] = past.values

    def attend(i: int, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        queries, keys, values = _split_rotated(w, qkv, cos, sin)
        cache.prompt_keys[i, :, :, depth:] = keys.transpose(1, 2)
        cache.prompt_values[i, :, :, depth:] = values.transpose(1, 2)
        if depth:  # every column: the past's and the new ones
            keys = cache.prompt_keys[i].transpose(1, 2)
            values = cache.prompt_values[i].transpose(1, 2)
        return _attend_prompt(queries, keys, values, mask)

    logits = _layers(w, tokens, positions, attend, _slots(record, slice(0, tokens.numel())))
    if record is not None:
        record.logits.index_copy_(0, record.prompt_last_slots(), logits)
    return logits


@torch.inference_mode()
def decode(w: LeanWeights, cache: KVCache, tokens: Tensor, positions: Tensor,
           record: RecordedForward | None = None, slots: slice | None = None) -> Tensor:
    """Feed one token per row (``tokens [rows]`` at ``positions``) into the next response
    column; the logits after it. With ``record``, the linears' outputs and the logits are
    written into its ``slots`` (one per row)."""
    column = cache.offset + cache.length
    cache.length += 1
    if w.pointers is not None and not cache.shared:  # every layer in one call
        return _decode_native(w, cache, tokens, positions, column, record, slots)

    def attend(i: int, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        keys, values = cache.keys[i, :, :, column], cache.values[i, :, :, column]
        if w.native is not None:  # rotated and stored in one call
            queries = w.native.rotate_store(qkv[:, 0], cos[:, 0, 0], sin[:, 0, 0], keys, values,
                                            w.heads)
        else:
            queries, new_keys, new_values = (t[:, 0] for t in _split_rotated(w, qkv, cos, sin))
            keys.copy_(new_keys)
            values.copy_(new_values)
        return _attend_decode(queries, cache, i, w.native)[:, None]

    return _layers(w, tokens[:, None], positions[:, None], attend, _slots(record, slots),
                   None if record is None else record.logits[slots])


def _decode_native(w: LeanWeights, cache: KVCache, tokens: Tensor, positions: Tensor,
                   column: int, record: RecordedForward | None, slots: slice | None) -> Tensor:
    """:func:`decode`'s layers in one call of postrl's kernels (the per-row cache layout):
    the same kernels in the same order as :func:`_layers` runs them, without its Python."""
    hidden = F.embedding(tokens, w.embed).to(w.dtype)  # [rows, width], added to in place
    cos, sin = (t[:, 0].contiguous() for t in w.rotary(hidden[:, None], positions[:, None]))
    outputs = None
    if record is not None:  # each linear's output straight into the record's slots
        outputs = [out.data_ptr() + slots.start * out.stride(0) * out.element_size()
                   for layer in record.linears for out in layer]
    normed = w.native.decode_layers(w.pointers, hidden, cos, sin, cache.keys, cache.values,
                                    column, cache.row_mask, outputs)
    return w.lm_head(normed, None if record is None else record.logits[slots])


# Prompt length (the padded prompts' width) from which a prompt's columns are shared by its
# samples, where a decode step runs the Python layer loop: for short prompts its second
# attention call costs more than the copies it saves, for long ones it measured faster
# (decode steps alternated in one process, bench/log.md).
SHARE_PROMPTS_FROM = 64
# The same where the per-row layout's decode steps run in one call of postrl's kernels
# (float32 on an AVX-512 or AVX2 CPU, bf16 too on one with AMX or AVX512-BF16): sharing (PyTorch's
# attention in two parts, the layer loop) then pays only for long prompts. Measured on the AMX
# machine (SmolLM2, 4 GSM8K prompts x 8, whole `generate` calls alternated in one process),
# per-row against shared: 56-96 tokens 0.79 (bf16) and 0.86 (fp32), 179-250 tokens 1.00 and
# 0.96, 331-433 tokens 1.16 and 1.07.
SHARE_PROMPTS_FROM_ONE_CALL = 256


class LeanDecoder:
    """The engine's decoder interface: prefill once, then one token per call; ``select``
    keeps only the given rows."""

    def __init__(self, weights: LeanWeights, input_ids: Tensor, attention: Tensor,
                 positions: Tensor, group_size: int, max_new_tokens: int,
                 share_from: int | None = None, record: RecordedForward | None = None,
                 past: Past | None = None) -> None:
        """``attention`` and ``positions`` cover ``past``'s columns too (if given) and then
        ``input_ids``' (``postrl.rollout.kept_turns.prefill_inputs``)."""
        self.weights, self.record = weights, record
        prompts, length = attention.shape
        self.rows = torch.arange(prompts * group_size)  # the call's row of each running row
        self.cache = KVCache(weights, prompts, length, group_size, max_new_tokens)
        logits = prefill(weights, self.cache, input_ids, positions[:, -input_ids.shape[1]:],
                         attention.bool(), record, past)
        # the G samples of a prompt share its prefill and its columns of the cache
        self.first_logits = logits.repeat_interleave(group_size, dim=0)
        if share_from is None:
            share_from = (SHARE_PROMPTS_FROM_ONE_CALL if weights.pointers is not None
                          else SHARE_PROMPTS_FROM)
        # nothing to share, not worth it, or no kernel for it
        if group_size == 1 or length < share_from or not _flash_available():
            self.cache.select(torch.arange(prompts * group_size))

    def select(self, keep: Tensor) -> None:
        self.cache.select(keep)
        self.rows = self.rows[keep]

    def kept(self, row: int, prompt: int, fed: int) -> tuple[Tensor, Tensor]:
        """Running row ``row``'s keys and values of its ``prompt`` tokens and the ``fed``
        response tokens after them, ``[layers, kv_heads, prompt + fed, dim]`` (copies)."""
        cache, columns = self.cache, self.cache.prompt_mask.shape[1]
        if not cache.shared:
            return tuple(getattr(cache, name)[:, row, :, columns - prompt:columns + fed].clone()
                         for name in ("keys", "values"))
        shared = row // cache.width
        return tuple(torch.cat((getattr(cache, f"prompt_{name}")[:, shared, :, columns - prompt:],
                                getattr(cache, name)[:, row, :, :fed]), dim=2)
                     for name in ("keys", "values"))

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        slots = (None if self.record is None
                 else self.record.next_block(self.rows, self.cache.length))
        return decode(self.weights, self.cache, tokens, positions, self.record, slots)
