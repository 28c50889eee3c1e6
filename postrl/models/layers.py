"""The training forward of a Llama-style body, one function per decoder layer.

transformers' decoder layer routes the prompt's keys and values through a cache object indexed
by the layer, repeats each key/value head over its group's query heads (``repeat_kv``, a copy
per layer and micro-batch, forward and backward) and scales the attention scores after the
matmul, a full pass over a ``[heads, L, P + L]`` tensor. Here a layer is a function of its
inputs and weights: the prompt's keys and values are passed in (already rotated, one entry
per row), a group's query heads are the query rows of their shared key/value head (the mask
is the same for every head), and the scale is folded into the queries (or into a backend's
fused softmax). With packed responses, a micro-batch's prompts and responses go through each
layer together (:func:`body_with_prompts`): one matmul per linear over both parts' tokens,
attention within each (what that saves: bench/log.md, "Prompts and responses through each
linear together"). Each building block (norm, rotation, attention, linears, SwiGLU) is the
active backend's (``postrl.models.backend``): PyTorch's operations, or faster kernels that
compute the same.

The maths is the model's own: RMSNorm in float32 rounded once before the weight, the model's
rotary module, the attention softmax in float32, SwiGLU. :func:`unsupported_reason` names what
this does not cover (those models keep transformers' forward); the modules it reads are the
model's own, so gradients land on the model's parameters.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from postrl.models import backend
from postrl.models.adapters import linear_reason

MODEL_TYPES = ("llama", "qwen2")


@dataclass
class KeysValues:
    """Rotated keys and values of every layer, ``[rows, kv_heads, columns, head_dim]`` each."""

    keys: list[Tensor]
    values: list[Tensor]

    def select(self, rows: Tensor) -> KeysValues:
        """Row ``i`` of the result is row ``rows[i]`` (differentiable: gradients add up)."""
        return KeysValues([k.index_select(0, rows) for k in self.keys],
                          [v.index_select(0, rows) for v in self.values])


def architecture_reason(model, adapters: bool = False) -> str | None:
    """What in ``model`` is not a plain Llama/Qwen2 decoder with a plain LM head (None when
    nothing is); with ``adapters``, LoRA layers whose weight merges count as plain."""
    reason = body_reason(model, adapters)
    if reason is None and not hasattr(model, "lm_head"):
        return "an unfamiliar module layout"
    if reason is None and (type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None):
        return "a non-plain LM head"
    return reason


def body_reason(model, adapters: bool = False) -> str | None:
    """What in ``model.model`` (the decoder body) or ``model.config`` is not a plain Llama/Qwen2
    decoder (None when nothing is); with ``adapters``, LoRA layers whose weight merges
    (:func:`postrl.models.adapters.linear_reason`) count as plain."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers"):
        return "an unfamiliar module layout"
    for layer in body.layers:  # peft adapters or quantised linears: leave them to transformers
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        reason = next(filter(None, map(linear_reason if adapters else _plain_reason, linears)),
                      None)
        if reason is not None:
            return reason
    return None


def _plain_reason(module: nn.Module) -> str | None:
    """None for a plain ``nn.Linear``; else why the training body leaves ``module`` alone."""
    if type(module) is nn.Linear:
        return None
    return "non-plain linear layers (adapters or quantisation)"


def unsupported_reason(model) -> str | None:
    """Why :func:`body` cannot run ``model``'s training forward (None when it can); only the
    body counts (the LM head is not part of it)."""
    reason = body_reason(model)
    if reason is not None:
        return reason
    if getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def body(model, input_ids: Tensor, position_ids: Tensor, bias: Tensor,
         past: KeysValues | None = None, compiled: bool = False) -> tuple[Tensor, KeysValues]:
    """``(last hidden states [B, L, H], this call's keys and values)`` of ``model.model`` over
    ``input_ids [B, L]`` after ``past`` (``P`` columns per row, or none); ``bias [B, 1, L,
    P + L]`` is additive (0 where a column may attend). ``compiled``: each layer runs the
    ``torch.compile``d layer function when gradients are on (one graph serves every layer, with
    dynamic lengths; forwards without gradients, and micro-batches with a size of 1, stay eager
    rather than compile again: :func:`_compiled`)."""
    inner = model.model
    sizes = (*input_ids.shape, *(() if past is None else past.keys[0].shape[2:3]))
    layer_fn = (_compiled_layer() if compiled and torch.is_grad_enabled()
                and _compile_sizes(*sizes) else _layer)
    hidden = inner.embed_tokens(input_ids)
    cos, sin = (t[:, None] for t in inner.rotary_emb(hidden, position_ids))  # [B, 1, L, d]
    keys, values = [], []
    for i, layer in enumerate(inner.layers):
        hidden, key, value = _run(layer_fn, layer, hidden, cos, sin, bias,
                                  None if past is None else past.keys[i],
                                  None if past is None else past.values[i])
        keys.append(key)
        values.append(value)
    return _rms_norm(hidden, inner.norm), KeysValues(keys, values)


def body_with_prompts(model, prompt_ids: Tensor, prompt_positions: Tensor, prompt_bias: Tensor,
                      input_ids: Tensor, position_ids: Tensor, bias: Tensor, prompt_of_row: Tensor,
                      compiled: bool = False) -> tuple[Tensor, Tensor]:
    """``(prompt hidden [n, P, H], hidden [B, L, H])``, both after the final norm: what
    :func:`body` gives over the prompts, and then over ``input_ids`` after the prompts' keys
    and values (row ``b`` continues prompt ``prompt_of_row[b]``; ``bias [B, 1, L, P + L]``).

    Each layer multiplies the prompts' tokens and the rows' tokens by its weights in one
    matmul, not two: a micro-batch's prompts are a few dozen tokens, where a matmul of their
    own runs far below the rate of a larger one, forward and backward (docs/performance.md).
    Where the backend serves these tokens' linears from what it kept of the sampler's
    forward (``postrl.models.backend.KeptForward``), they read it through :func:`_linears`,
    tokens in this order (callers then run the layers eagerly: not ``compiled``)."""
    inner = model.model
    layer_fn = (_compiled_pair_layer() if compiled and torch.is_grad_enabled()
                and _compile_sizes(*prompt_ids.shape, *input_ids.shape) else _pair_layer)
    prompt_hidden = inner.embed_tokens(prompt_ids)
    hidden = inner.embed_tokens(input_ids)
    prompt_angles = tuple(t[:, None] for t in inner.rotary_emb(prompt_hidden, prompt_positions))
    angles = tuple(t[:, None] for t in inner.rotary_emb(hidden, position_ids))
    shapes = (prompt_hidden.shape, hidden.shape)
    flat = torch.cat([prompt_hidden.flatten(0, 1), hidden.flatten(0, 1)])
    for layer in inner.layers:
        flat = _run(layer_fn, layer, flat, shapes, prompt_angles, angles, prompt_bias, bias,
                    prompt_of_row)
    flat = _rms_norm(flat, inner.norm)
    split = prompt_ids.numel()
    return flat[:split].view(prompt_hidden.shape), flat[split:].view(hidden.shape)


def _run(layer_fn, layer, *args, **kwargs):
    """``layer_fn(layer, ...)``, its activations recomputed in the backward rather than kept
    where the layer says so (``gradient_checkpointing``, the flag transformers'
    ``activation_checkpointing_enable`` sets). Unlike transformers, in eval mode too: postrl
    trains in either (no dropout), and the recomputed forward equals the first (the backend's
    ``recompute_contexts``: what its linears read, they read again)."""
    if torch.is_grad_enabled() and getattr(layer, "gradient_checkpointing", False):
        return checkpoint(layer_fn, layer, *args, use_reentrant=False,
                          context_fn=backend.active().recompute_contexts, **kwargs)
    return layer_fn(layer, *args, **kwargs)


def checkpointed(model) -> bool:
    """Whether a forward of ``model`` (a module, or a wrapper with the body as ``.model``)
    may now recompute some layer in the backward."""
    modules = (model if isinstance(model, nn.Module) else model.model).modules()
    return torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False)
                                           for m in modules)


def _compiled(layer_fn):
    """``layer_fn`` under ``torch.compile`` with every size symbolic: one graph for every
    micro-batch whose sizes are all 2 or more. Dynamo would otherwise equate sizes that happen
    to be equal when it traces (rows and tokens, say) and compile again at the first call where
    they differ (``use_duck_shape``); sizes of 0 or 1 it always specialises (callers run those
    micro-batches eagerly: :func:`_compile_sizes`)."""
    compiled = torch.compile(layer_fn, dynamic=True)
    # a private setting of PyTorch's (2.13): where a release drops it, compile as it would
    unduck = (functools.partial(fx_config.patch, use_duck_shape=False)
              if hasattr(fx_config, "use_duck_shape") else contextlib.nullcontext)

    def run(*args, **kwargs):
        with unduck():
            return compiled(*args, **kwargs)

    return run


def _compile_sizes(*sizes: int) -> bool:
    """Whether a micro-batch of these sizes runs the compiled layer: none is 0 or 1."""
    return min(sizes) >= 2


def causal_bias(attention_mask: Tensor, dtype: torch.dtype, queries: int | None = None
                ) -> Tensor:
    """``[B, 1, Q, W]`` for the last ``queries`` (default all) of ``attention_mask``'s ``W``
    columns: each sees the attended columns up to itself."""
    width = attention_mask.shape[1]
    queries = width if queries is None else queries
    causal = torch.ones(queries, width, dtype=torch.bool,
                        device=attention_mask.device).tril(width - queries)
    allowed = causal & attention_mask.bool()[:, None, :]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@functools.cache
def _compiled_layer():
    return _compiled(_layer)


def _layer(layer, hidden: Tensor, cos: Tensor, sin: Tensor, bias: Tensor,
           past_key: Tensor | None, past_value: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    attn = layer.self_attn
    rows, width, _ = hidden.shape
    dim = attn.head_dim
    x = _rms_norm(hidden, layer.input_layernorm)
    query = _linear(x, attn.q_proj).view(rows, width, -1, dim).transpose(1, 2)
    key = _linear(x, attn.k_proj).view(rows, width, -1, dim).transpose(1, 2)
    value = _linear(x, attn.v_proj).view(rows, width, -1, dim).transpose(1, 2)
    query, key = rotate(query, cos, sin), rotate(key, cos, sin)
    keys = key if past_key is None else torch.cat([past_key, key], dim=2)
    values = value if past_value is None else torch.cat([past_value, value], dim=2)
    out = _attend(query, keys, values, bias, attn.scaling)
    return _mlp_block(layer, hidden + _linear(out, attn.o_proj)), key, value


@functools.cache
def _compiled_pair_layer():
    return _compiled(_pair_layer)


def _pair_layer(layer, flat: Tensor, shapes, prompt_angles, angles, prompt_bias: Tensor,
                bias: Tensor, prompt_of_row: Tensor) -> Tensor:
    """:func:`_layer` over the prompts' tokens and the rows' tokens, concatenated in ``flat``
    (``[n * P + B * L, H]``, shapes ``[n, P, H]`` and ``[B, L, H]``): every linear runs once
    over both; attention runs within the prompts, then for each row over its prompt's keys
    and values and its own."""
    attn, dim = layer.self_attn, layer.self_attn.head_dim
    (prompts, length, _), (rows, width, _) = shapes
    split = prompts * length

    def heads(t: Tensor) -> tuple[Tensor, Tensor]:  # [n, h, P, d] and [B, h, L, d]
        return (t[:split].view(prompts, length, -1, dim).transpose(1, 2),
                t[split:].view(rows, width, -1, dim).transpose(1, 2))

    x = _rms_norm(flat, layer.input_layernorm)
    (prompt_query, query), (prompt_key, key), (prompt_value, value) = (
        heads(t) for t in _linears(x, (attn.q_proj, attn.k_proj, attn.v_proj)))
    prompt_query, prompt_key = (rotate(t, *prompt_angles) for t in (prompt_query, prompt_key))
    query, key = (rotate(t, *angles) for t in (query, key))
    prompt_out = _attend(prompt_query, prompt_key, prompt_value, prompt_bias, attn.scaling)
    keys = torch.cat([prompt_key.index_select(0, prompt_of_row), key], dim=2)
    values = torch.cat([prompt_value.index_select(0, prompt_of_row), value], dim=2)
    out = _attend(query, keys, values, bias, attn.scaling)
    out = torch.cat([prompt_out.flatten(0, 1), out.flatten(0, 1)])
    return _mlp_block(layer, flat + _linear(out, attn.o_proj))


def _mlp_block(layer, hidden: Tensor) -> Tensor:
    """The layer's second half: ``hidden`` plus its SwiGLU MLP of the normed ``hidden``."""
    mlp = layer.mlp
    x = _rms_norm(hidden, layer.post_attention_layernorm)
    gate, up = _linears(x, (mlp.gate_proj, mlp.up_proj))
    return hidden + _linear(backend.active().swiglu(gate, up), mlp.down_proj)


def _linear(x: Tensor, module: nn.Linear) -> Tensor:
    """``module(x)``, by the backend."""
    return _linears(x, (module,))[0]


def _linears(x: Tensor, modules: tuple[nn.Linear, ...]) -> list[Tensor]:
    """:func:`_linear` of each of ``modules``, which read the same ``x``: a backend may run
    their backward as one, and serve their outputs from what it kept of the sampler's forward
    (the groups are those the sampler fuses: q|k|v, o, gate|up, down)."""
    return backend.active().linears(x, [m.weight for m in modules], [m.bias for m in modules])


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """transformers' RMSNorm: normalised in float32, rounded to ``x``'s dtype, then weighted."""
    return backend.active().rms_norm(x, norm.weight, norm.variance_epsilon)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (last dimension: the head's, in two halves) at the
    angles whose cosines and sines are ``cos``/``sin`` (broadcast against ``x``)."""
    return backend.active().rotate(x, cos, sin)


def _attend(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``[B, L, heads * d]``: ``query [B, heads, L, d]`` over ``keys`` and ``values [B,
    kv_heads, T, d]``, the scores times ``scale``; query head ``h`` reads key/value head
    ``h // group`` (:func:`postrl.models.ops.attention`, or the backend's)."""
    return backend.active().attention(query, keys, values, bias, scale)
