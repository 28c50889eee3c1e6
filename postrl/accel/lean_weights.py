"""The lean sampler's weights: one snapshot of a model's, ready for sampling
(:class:`LeanWeights`, rebuilt after every update; ``postrl.accel.lean`` runs them).

Once per ``generate`` call, the projections are fused (q|k|v, gate|up; a LoRA layer's
adapters merged into its weight, :mod:`postrl.models.adapters`), cast to the sampling dtype
and packed for the fastest kernel here (:class:`Linear`): postrl's own in float32
(``gemm.c``) and, on a CPU with AMX tiles or AVX512-BF16, in bf16 (``dpbf16.c``); else
oneDNN's blocked layout.
Where every layer's linears are postrl's, the layers are also described to the one-call decode
step (``LayerPointers``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from postrl.accel.native import AMX_INPUTS, LayerPointers, NativeKernels, native_kernels
from postrl.models.adapters import effective_linear
from postrl.models.precision import onednn_runs_bf16

# The dtypes whose work between the linears runs postrl's kernels (``decode.c``). Measured on
# the AMX machine (SmolLM2, 4 prompts x 8, 64 new tokens; docs/performance.md): a bf16
# ``generate`` spent about half its time on PyTorch's operations between oneDNN's linears.
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    """``x W^T + b`` with ``W`` (the row-concatenation of ``weights``) cast to ``dtype`` and
    packed once for the fastest kernel here: with ``native`` (:mod:`postrl.accel.native`),
    postrl's own in float32 (``gemm.c``), and in bf16 on a CPU with AMX tiles or AVX512-BF16
    (``dpbf16.c``; inputs of a multiple of 32); else, where oneDNN is available, its blocked
    layout for ``rows``-row inputs."""

    def __init__(self, weights: list[Tensor], biases: list[Tensor | None], dtype: torch.dtype,
                 rows: int, native: NativeKernels | None = None) -> None:
        self.bias = (None if biases[0] is None
                     else torch.cat([b.detach() for b in biases]).to(dtype))
        self.out_features = sum(w.shape[0] for w in weights)
        self.native = native if native is not None and _native_linear(
            native, dtype, weights[0].shape[1]) else None
        self.bf16 = self.native is not None and dtype == torch.bfloat16
        self.packed = self.native is None and _packable(dtype)
        if self.bf16:
            self.weight = self.native.bf16_pack(weights)  # cast and packed in one pass
            return
        if self.native is not None:  # packed from the weights themselves, without a copy
            self.weight, self.bias = self.native.pack(weights), self.native.pad_bias(self.bias)
            return
        weight = torch.cat([w.detach() for w in weights]).to(dtype)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, max(rows, 1))
        else:
            self.weight = weight

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """``x [..., in]`` times the weight, ``[..., out]``; with ``out`` (``[rows, out]``,
        contiguous: a record's slots) the product is also written there, by postrl's linear
        itself (then the result is ``out``'s view) or by a copy."""
        if self.bf16:
            return self.native.bf16_linear(x, self.weight, self.bias, self.out_features, out)
        if self.native is not None:
            return self.native.linear(x, self.weight, self.bias, self.out_features, out)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        if out is not None:
            out.copy_(y.reshape(out.shape))
        return y


def _native_linear(native: NativeKernels, dtype: torch.dtype, in_features: int) -> bool:
    """Whether postrl's own linear multiplies ``dtype`` inputs of ``in_features`` here."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and native.bf16_linears and in_features % AMX_INPUTS == 0


def _packable(dtype: torch.dtype) -> bool:
    """oneDNN is there and handles ``dtype`` on this CPU (bf16/fp16 need ISA support)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return onednn_runs_bf16()
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
    # postrl's own kernels, where available: between the linears in float32 and bf16, the
    # linears themselves in float32 and, with AMX or AVX512-BF16, bf16 (``Linear``), and
    # whole decode steps (``pointers``) where every layer's linears are theirs
    native: NativeKernels | None = None
    pointers: LayerPointers | None = None  # the layers, for ``native.decode_layers``

    @classmethod
    @torch.no_grad()
    def of(cls, model, dtype: torch.dtype, rows: int) -> LeanWeights:
        config, body = model.config, model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        native = native_kernels() if dtype in NATIVE_DTYPES else None
        linear = functools.partial(Linear, dtype=dtype, rows=rows, native=native)
        layers = []

        def fused(*modules: nn.Module) -> Linear:  # their weights as applied, adapters merged
            pairs = [effective_linear(m) for m in modules]
            return linear([w for w, _ in pairs], [b for _, b in pairs])

        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(Layer(
                fused(attn.q_proj, attn.k_proj, attn.v_proj), fused(attn.o_proj),
                fused(mlp.gate_proj, mlp.up_proj), fused(mlp.down_proj),
                layer.input_layernorm.weight.detach().to(dtype),
                layer.post_attention_layernorm.weight.detach().to(dtype)))
        norm = body.norm.weight.detach().to(dtype)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        pointers = None
        by_layer = [(layer.qkv, layer.out, layer.gate_up, layer.down) for layer in layers]
        if native is not None and all(m.native is not None for ms in by_layer for m in ms):
            linears = [[(m.weight, m.bias) for m in ms] for ms in by_layer]  # postrl's own
            norms = [n.contiguous() for layer in layers
                     for n in (layer.input_norm, layer.post_norm)] + [norm.contiguous()]
            pointers = LayerPointers.of(linears, norms, heads, kv_heads, head_dim,
                                        layers[0].gate_up.out_features // 2,
                                        body.norm.variance_epsilon)
        return cls(body.embed_tokens.weight.detach(), layers, norm,
                   linear([model.lm_head.weight], [None]), body.rotary_emb,
                   body.norm.variance_epsilon, heads, kv_heads, head_dim, dtype, native,
                   pointers)


